"""prefill_attention (blocked GEMMs and SDPA) against an explicit masked-softmax reference."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvhive.model import attention
from kvhive.model.attention import prefill_attention

F32_TOL = dict(atol=1e-5, rtol=1e-5)
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Queries at the last n of ctx positions; explicit KV repeat and masked softmax, in float32."""
    n, heads, hd = q.shape
    ctx, kv_heads, _ = k.shape
    k, v = (t.float().repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) / hd ** 0.5
    visible = torch.ones(n, ctx, dtype=torch.bool).tril(ctx - n)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v).reshape(n, heads * hd)


def inputs(n: int, prefix: int, heads: int, kv_heads: int, hd: int, dtype: torch.dtype, seed: int = 0):
    """q [n, heads, hd] and k, v [prefix + n, kv_heads, hd] as strided views, as the runner passes them."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads + 2 * kv_heads, hd, generator=g).to(dtype)[:, :heads]     # fused qkv rows
    kv = torch.randn(prefix + n, 2, kv_heads, hd, generator=g).to(dtype)
    return q, kv[:, 0], kv[:, 1]


def use_blocked(monkeypatch, blocked: bool) -> None:
    """Send every prefill to the blocked GEMMs (True) or to SDPA (False)."""
    monkeypatch.setattr(attention, "PREFILL_BLOCKED_NEW_TOKENS", (1, 10 ** 9) if blocked else (1, 0))
    monkeypatch.setattr(attention, "PREFILL_BLOCKED_MAX_KEYS", 10 ** 9)


@pytest.fixture(params=["blocked-2-threads", "blocked-1-thread", "sdpa"])
def path(request, monkeypatch) -> Iterator[str]:
    """Force one implementation; small query blocks so that chunks span several, with a ragged last one.

    With 3 KV heads, 2 threads cut each block into two parts; 1 thread keeps it whole.
    """
    monkeypatch.setattr(attention, "PREFILL_QUERY_BLOCK", 16)
    use_blocked(monkeypatch, request.param != "sdpa")
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if request.param == "blocked-1-thread" else 2)
    yield request.param
    torch.set_num_threads(threads)


@pytest.mark.parametrize("n", [1, 2, 16, 17, 50])
@pytest.mark.parametrize("prefix", [0, 5, 37])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 2)])
def test_matches_reference_float32(path: str, n: int, prefix: int, heads: int, kv_heads: int) -> None:
    q, k, v = inputs(n, prefix, heads, kv_heads, 16, torch.float32)
    torch.testing.assert_close(prefill_attention(q, k, v), reference(q, k, v), **F32_TOL)


@pytest.mark.parametrize("prefix", [0, 21])
def test_matches_reference_bfloat16(path: str, prefix: int) -> None:
    q, k, v = inputs(40, prefix, 9, 3, 64, torch.bfloat16)
    got = prefill_attention(q, k, v)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference(q, k, v), **BF16_TOL)


def test_runner_mask_is_honoured_by_sdpa(monkeypatch) -> None:
    """The SDPA path uses the span's mask when the runner gives one (it equals the causal one)."""
    use_blocked(monkeypatch, False)
    q, k, v = inputs(12, 20, 4, 2, 16, torch.float32)
    mask = torch.ones(12, 32, dtype=torch.bool).tril(20)
    torch.testing.assert_close(prefill_attention(q, k, v, mask), reference(q, k, v), **F32_TOL)


def test_blocked_equals_sdpa_at_a_real_shape(monkeypatch) -> None:
    """SmolLM2-135M's attention shape, several default-sized blocks, on a cached prefix."""
    q, k, v = inputs(300, 100, 9, 3, 64, torch.float32, seed=1)
    use_blocked(monkeypatch, True)
    blocked = prefill_attention(q, k, v)
    use_blocked(monkeypatch, False)
    torch.testing.assert_close(blocked, prefill_attention(q, k, v), **F32_TOL)
