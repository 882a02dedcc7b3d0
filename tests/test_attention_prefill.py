"""prefill_attention (blocked GEMMs and SDPA) against an explicit masked-softmax reference."""

from __future__ import annotations

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


@pytest.fixture(params=["blocked", "sdpa"])
def path(request, monkeypatch) -> str:
    """Force one implementation; small query blocks so that chunks span several, with a ragged last one."""
    monkeypatch.setattr(attention, "PREFILL_QUERY_BLOCK", 16)
    monkeypatch.setattr(attention, "PREFILL_BLOCKED_TOKENS", (1, 10 ** 9) if request.param == "blocked" else (0, 0))
    return request.param


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
    monkeypatch.setattr(attention, "PREFILL_BLOCKED_TOKENS", (0, 0))
    q, k, v = inputs(12, 20, 4, 2, 16, torch.float32)
    mask = torch.ones(12, 32, dtype=torch.bool).tril(20)
    torch.testing.assert_close(prefill_attention(q, k, v, mask), reference(q, k, v), **F32_TOL)


def test_blocked_equals_sdpa_at_a_real_shape(monkeypatch) -> None:
    """SmolLM2-135M's attention shape, several default-sized blocks, on a cached prefix."""
    q, k, v = inputs(300, 100, 9, 3, 64, torch.float32, seed=1)
    monkeypatch.setattr(attention, "PREFILL_BLOCKED_TOKENS", (1, 10 ** 9))
    blocked = prefill_attention(q, k, v)
    monkeypatch.setattr(attention, "PREFILL_BLOCKED_TOKENS", (0, 0))
    torch.testing.assert_close(blocked, prefill_attention(q, k, v), **F32_TOL)
