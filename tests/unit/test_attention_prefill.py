"""Prefill attention (the C++ kernel over the pool, blocked GEMMs, SDPA) against an explicit masked-softmax reference."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvhive.model import attention, cpu
from kvhive.model.attention import prefill_attention
from kvhive.model.prefill_kernel import CpuPrefillKernel

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


@pytest.mark.parametrize("n,prefix", [(1, 0), (17, 0), (17, 37), (50, 5), (3, 61)])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4)])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_fused_sdpa_path_matches_reference(n: int, prefix: int, heads: int, kv_heads: int, device: str) -> None:
    """The path CUDA takes (KV heads repeated, lower-right causal bias instead of a mask tensor)."""
    q, k, v = inputs(n, prefix, heads, kv_heads, 16, torch.float32)
    got = attention._fused_sdpa_prefill(q.to(device), k.to(device), v.to(device))
    torch.testing.assert_close(got.reshape(n, -1).cpu(), reference(q, k, v), **F32_TOL)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_decode_matmuls_match_sdpa(device: str) -> None:
    """The float32 CUDA decode path (two GEMMs and a softmax) against SDPA, padded keys masked."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(5, 3, n, 16, generator=g) for n in (3, 40, 40))
    lens = torch.tensor([1, 7, 16, 33, 40])
    mask = (torch.arange(40)[None, :] < lens[:, None])[:, None, None, :]
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    got = attention._decode_matmuls(*(t.to(device) for t in (q, k, v, mask)))
    torch.testing.assert_close(got.cpu(), expected, **F32_TOL)


def test_blocked_equals_sdpa_at_a_real_shape(monkeypatch) -> None:
    """SmolLM2-135M's attention shape, several default-sized blocks, on a cached prefix."""
    q, k, v = inputs(300, 100, 9, 3, 64, torch.float32, seed=1)
    use_blocked(monkeypatch, True)
    blocked = prefill_attention(q, k, v)
    use_blocked(monkeypatch, False)
    torch.testing.assert_close(blocked, prefill_attention(q, k, v), **F32_TOL)


# The prefill kernel at every ISA level this CPU runs (None where the level has no prefill path).
KERNELS = {level: CpuPrefillKernel.load(level) for level in cpu.LEVELS if cpu.detect().supports(level)}


def kernel_levels(dtype: torch.dtype) -> list:
    """The levels to run a kernel test at; those without a kernel for ``dtype`` are skipped."""
    params = []
    for level, kernel in KERNELS.items():
        reason = ("no C++ compiler or no prefill path at this level" if kernel is None else
                  f"no {dtype} path at this level" if dtype not in kernel.dtypes else None)
        params.append(pytest.param(level, marks=pytest.mark.skipif(reason is not None, reason=reason or "")))
    return params


def pool_inputs(n: int, prefix: int, heads: int, kv_heads: int, hd: int, dtype: torch.dtype,
                block_size: int, layer: int = 1, seed: int = 0):
    """q and a 3-layer pool holding the sequence's K/V at `layer` in shuffled blocks; k, v gathered back."""
    g = torch.Generator().manual_seed(seed)
    ctx = prefix + n
    used = -(-ctx // block_size)
    pool = torch.randn(used + 5, 3, 2, block_size, kv_heads, hd, generator=g).to(dtype)
    block_ids = torch.randperm(used + 5, generator=g)[:used].to(torch.int64)
    q = torch.randn(n, heads + 2 * kv_heads, hd, generator=g).to(dtype)[:, :heads]
    k = pool[block_ids, layer, 0].reshape(-1, kv_heads, hd)[:ctx]
    v = pool[block_ids, layer, 1].reshape(-1, kv_heads, hd)[:ctx]
    return q, pool, block_ids, k, v


def test_levels_with_a_prefill_path() -> None:
    """Every SIMD level runs both pool dtypes; the portable level has no prefill path."""
    if all(kernel is None for kernel in KERNELS.values()):
        pytest.skip("no C++ compiler, or a CPU with no SIMD level")
    for level, kernel in KERNELS.items():
        if level == "portable":
            assert kernel is None
        else:
            assert kernel is not None and kernel.isa == level
            assert kernel.dtypes == {torch.float32, torch.bfloat16}


@pytest.mark.parametrize("level", kernel_levels(torch.float32))
@pytest.mark.parametrize("n,prefix", [(1, 0), (1, 40), (15, 0), (16, 16), (17, 3), (50, 0), (33, 100), (200, 0)])
@pytest.mark.parametrize("heads,kv_heads,hd", [(9, 3, 64), (4, 4, 16), (8, 2, 32), (4, 1, 128)])
@pytest.mark.parametrize("block_size", [16, 5, 32])
def test_kernel_matches_reference_float32(level: str, n: int, prefix: int, heads: int, kv_heads: int, hd: int,
                                          block_size: int) -> None:
    q, pool, ids, k, v = pool_inputs(n, prefix, heads, kv_heads, hd, torch.float32, block_size)
    torch.testing.assert_close(KERNELS[level](q, pool, 1, ids, prefix), reference(q, k, v), **F32_TOL)


def bf16_kernel(level: str, path: str) -> CpuPrefillKernel:
    """A kernel at ``level`` held to one bf16 path (a level without the wide path runs its own)."""
    kernel = CpuPrefillKernel.load(level)
    kernel.pick_bf16_path(path)
    return kernel


@pytest.mark.parametrize("level", kernel_levels(torch.bfloat16))
@pytest.mark.parametrize("path", ["native", "wide"])
@pytest.mark.parametrize("n,prefix,block_size", [(1, 0, 16), (17, 3, 5), (40, 21, 16), (33, 100, 5), (130, 600, 16)])
@pytest.mark.parametrize("heads,kv_heads,hd", [(9, 3, 64), (4, 4, 16), (8, 2, 32), (4, 1, 128)])
def test_kernel_matches_reference_bfloat16(level: str, path: str, n: int, prefix: int, heads: int, kv_heads: int,
                                           hd: int, block_size: int) -> None:
    q, pool, ids, k, v = pool_inputs(n, prefix, heads, kv_heads, hd, torch.bfloat16, block_size)
    got = bf16_kernel(level, path)(q, pool, 1, ids, prefix)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference(q, k, v), **BF16_TOL)


@pytest.mark.parametrize("level", kernel_levels(torch.bfloat16))
def test_wide_bfloat16_is_the_float32_path_rounded_once(level: str) -> None:
    """The wide path widens bf16 exactly and runs the float32 kernel: its result is the float32
    result on the same values, rounded to bf16 (nearest even) bit for bit."""
    kernel = bf16_kernel(level, "wide")
    if kernel.bf16_path != "wide":
        pytest.skip(f"no 16-lane float32 path at {level}")
    q, pool, ids, _, _ = pool_inputs(45, 70, 9, 3, 64, torch.bfloat16, 16)
    got = kernel(q, pool, 1, ids, 70)
    want = kernel(q.float(), pool.float(), 1, ids, 70).to(torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_bf16_path_choice() -> None:
    """auto measures and settles on one path; native and wide are taken as asked (wide only where the
    build has it); anything else is refused."""
    kernel = next((k for k in KERNELS.values() if k is not None and torch.bfloat16 in k.dtypes), None)
    if kernel is None:
        pytest.skip("no bf16 prefill kernel on this CPU")
    kernel = CpuPrefillKernel.load(kernel.isa)
    assert kernel.bf16_path == "auto"
    assert kernel.pick_bf16_path() in ("native", "wide") and kernel.bf16_path != "auto"
    assert kernel.pick_bf16_path("native") == "native"
    assert kernel.pick_bf16_path("wide") == ("wide" if kernel.isa.startswith("avx512") else "native")
    with pytest.raises(ValueError, match="bf16 path"):
        kernel.pick_bf16_path("fastest")


@pytest.mark.skipif(KERNELS.get("avx2") is None, reason="no AVX2 kernel on this CPU")
def test_avx2_bfloat16_is_the_float32_path_rounded_once() -> None:
    """AVX2 widens bf16 exactly and computes in float32: the bf16 result is the float32 result on
    the same values, rounded to bf16 (nearest even) bit for bit."""
    kernel = KERNELS["avx2"]
    q, pool, ids, _, _ = pool_inputs(45, 70, 9, 3, 64, torch.bfloat16, 16)
    got = kernel(q, pool, 1, ids, 70)
    want = kernel(q.float(), pool.float(), 1, ids, 70).to(torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("level", kernel_levels(torch.bfloat16))
def test_kernel_workspace_holds_the_packed_tiles(level: str) -> None:
    """A fresh kernel's first call (a bf16 pool) gets room for every packed tile in the kernel's
    own element width (float32 where bf16 is widened when packed)."""
    kernel = CpuPrefillKernel.load(level)
    q, pool, ids, k, v = pool_inputs(70, 130, 8, 2, 32, torch.bfloat16, 16)
    torch.testing.assert_close(kernel(q, pool, 1, ids, 130).float(), reference(q, k, v), **BF16_TOL)
    # vdpbf16ps reads bf16 tiles; AVX2 and the wide path widen them
    packed_bytes = 2 if level == "avx512_bf16" and kernel.bf16_path == "native" else 4
    tiles = -(-200 // 32)
    assert kernel._ws.numel() >= 2 * 2 * tiles * 32 * 32 * packed_bytes


@pytest.mark.parametrize("level", kernel_levels(torch.float32))
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_reference_at_1_and_2_threads(level: str, threads: int) -> None:
    """However the packing and the items are shared out between threads."""
    q, pool, ids, k, v = pool_inputs(90, 50, 9, 3, 64, torch.float32, 16)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = KERNELS[level](q, pool, 1, ids, 50)
    finally:
        torch.set_num_threads(saved)
    torch.testing.assert_close(got, reference(q, k, v), **F32_TOL)


@pytest.mark.parametrize("level", kernel_levels(torch.float32))
def test_kernel_reads_only_its_layer_and_context(level: str) -> None:
    """Other layers and blocks past the context may hold anything (here NaN): the result is unchanged."""
    kernel = KERNELS[level]
    q, pool, ids, k, v = pool_inputs(20, 30, 9, 3, 64, torch.float32, 16)
    want = kernel(q, pool, 1, ids, 30)
    poisoned = pool.clone()
    poisoned[:, [0, 2]] = float("nan")
    keep = torch.zeros(poisoned.shape[0], dtype=torch.bool)
    keep[ids] = True
    poisoned[~keep] = float("nan")
    last = ids[-1]
    poisoned[last, 1, :, 50 % 16:] = float("nan")        # the last block's slots past position 49
    torch.testing.assert_close(kernel(q, poisoned, 1, ids, 30), want, rtol=0, atol=0)


@pytest.mark.parametrize("level", kernel_levels(torch.float32))
def test_kernel_rejects_a_short_block_table(level: str) -> None:
    q, pool, ids, _, _ = pool_inputs(20, 30, 9, 3, 64, torch.float32, 16)
    with pytest.raises(ValueError, match="cannot hold"):
        KERNELS[level](q, pool, 1, ids[:-1], 30)
