"""The C++ prefill kernel over 8-bit KV pools (int8 and fp8 rows of kvhive.model.kv_quant) against a
float64 causal reference over the pool's dequantised values, at every SIMD level this CPU runs."""

from __future__ import annotations

import pytest
import torch

from kvhive.model import cpu
from kvhive.model.kv_quant import dequantize_rows, pool_dtype, quantize_rows
from kvhive.model.native import build_library, kernel_source
from kvhive.model.prefill_kernel import CpuPrefillKernel

SIMD_LEVELS = [level for level in cpu.LEVELS if level != "portable"]
KERNELS = {level: CpuPrefillKernel.load(level) for level in SIMD_LEVELS if cpu.detect().supports(level)}
KV_DTYPES = ("int8", "fp8")
Q_DTYPES = (torch.float32, torch.bfloat16)


def level_params() -> list:
    """The SIMD levels, skipped where this CPU does not run them or no compiler built the kernel."""
    params = []
    for level in SIMD_LEVELS:
        reason = ("the CPU lacks this level" if level not in KERNELS else
                  "no C++ compiler" if KERNELS[level] is None else None)
        params.append(pytest.param(level, marks=pytest.mark.skipif(reason is not None, reason=reason or "")))
    return params


def quantized_pool(n: int, prefix: int, heads: int, kv_heads: int, hd: int, kv_dtype: str, block_size: int,
                   q_dtype: torch.dtype, layer: int = 1, seed: int = 0):
    """q (strided, as the runner passes it), a 3-layer 8-bit pool holding the sequence at ``layer`` in
    shuffled blocks, its block ids, and the sequence's dequantised k, v (float64).

    About one row in six is special: all zeros (scale 0), tiny (1e-30), or large (K x 4, V x 1e15).
    """
    g = torch.Generator().manual_seed(seed)
    ctx = prefix + n
    used = -(-ctx // block_size)
    x = torch.randn(used + 3, 3, 2, block_size, kv_heads, hd, generator=g)
    pick = torch.rand(x.shape[:-1], generator=g)
    for kv, large in ((0, 4.0), (1, 1e15)):
        p = pick[:, :, kv]
        factor = torch.where(p < 0.05, 0.0, torch.where(p < 0.1, 1e-30, torch.where(p < 0.17, large, 1.0)))
        x[:, :, kv] *= factor.unsqueeze(-1)
    pool = quantize_rows(x, kv_dtype)
    ids = torch.randperm(used + 3, generator=g)[:used].contiguous()
    q = torch.randn(n, heads + 2 * kv_heads, hd, generator=g).to(q_dtype)[:, :heads]
    values = dequantize_rows(pool, torch.float64)[ids, layer]
    k, v = (values[:, kv].reshape(-1, kv_heads, hd)[:ctx] for kv in (0, 1))
    return q, pool, ids, k, v


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of q (the last n of ctx positions) in float64, and P @ |V|: the size of the
    terms each output sums (the scale of its float32 rounding error)."""
    n, heads, hd = q.shape
    ctx, kv_heads, _ = k.shape
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / hd ** 0.5
    visible = torch.ones(n, ctx, dtype=torch.bool).tril(ctx - n)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    out, size = (torch.einsum("hqk,khd->qhd", probs, t).reshape(n, heads * hd) for t in (v, v.abs()))
    return out, size


def assert_matches(got: torch.Tensor, want: torch.Tensor, size: torch.Tensor) -> None:
    """float32: within ~1e-5 of the terms' size; bf16: also within bf16's rounding of the result."""
    rounding = 2.0 ** -8 if got.dtype == torch.bfloat16 else 1e-5
    err = (got.double() - want).abs()
    bound = 2e-5 * size + rounding * want.abs()
    worst = (err - bound).argmax()
    assert (err <= bound).all(), (f"{got.dtype}: got {got.flatten()[worst].item()} want "
                                  f"{want.flatten()[worst].item()} (terms {size.flatten()[worst].item()})")


CASES = [   # n, prefix, block_size, heads, kv_heads, hd
    (1, 0, 16, 4, 4, 64),
    (15, 0, 32, 6, 3, 128),
    (16, 16, 16, 9, 3, 64),      # the prefix ends on a block edge
    (17, 21, 16, 8, 2, 128),     # ... mid-block; the context crosses a tile
    (100, 0, 32, 9, 3, 64),
    (100, 45, 5, 4, 2, 64),
    (1, 40, 32, 8, 2, 64),
    (33, 70, 16, 4, 1, 32),
]


@pytest.mark.parametrize("level", level_params())
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("q_dtype", Q_DTYPES, ids=["q_float32", "q_bf16"])
@pytest.mark.parametrize("n,prefix,block_size,heads,kv_heads,hd", CASES)
def test_matches_float64_reference(level: str, kv_dtype: str, q_dtype: torch.dtype, n: int, prefix: int,
                                   block_size: int, heads: int, kv_heads: int, hd: int) -> None:
    q, pool, ids, k, v = quantized_pool(n, prefix, heads, kv_heads, hd, kv_dtype, block_size, q_dtype)
    got = KERNELS[level](q, pool, 1, ids, prefix)
    assert got.dtype == q_dtype and got.shape == (n, heads * hd)
    assert_matches(got, *reference(q, k, v))


@pytest.mark.parametrize("level", level_params())
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_is_the_float_pool_of_its_values(level: str, kv_dtype: str) -> None:
    """Dequantisation is exact: an 8-bit pool gives, bit for bit, what a float32 pool of its values
    gives (float32 queries), and that result rounded once to bf16 (bf16 queries)."""
    kernel = KERNELS[level]
    q, pool, ids, _, _ = quantized_pool(45, 70, 9, 3, 64, kv_dtype, 16, torch.bfloat16)
    float_pool = dequantize_rows(pool)
    want = kernel(q.float(), float_pool, 1, ids, 70)
    assert torch.equal(kernel(q.float(), pool, 1, ids, 70), want)
    got = kernel(q, pool, 1, ids, 70)
    assert torch.equal(got.view(torch.int16), want.to(torch.bfloat16).view(torch.int16))


def every_code_pool(kv_dtype: str, scale: float) -> torch.Tensor:
    """One block of one layer whose token 0 holds, in V over 2 KV heads of 128, all 256 byte codes (a
    NaN E4M3 code replaced by 0) with one bf16 scale; K rows of zeros."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    if kv_dtype == "fp8":
        codes[(codes & 0x7F) == 0x7F] = 0
    raw = torch.zeros(1, 1, 2, 16, 2, 130, dtype=torch.uint8)
    raw[0, 0, 1, 0, :, :128] = codes.view(2, 128)
    raw[0, 0, 1, 0, :, 128:] = torch.tensor([scale], dtype=torch.bfloat16).view(torch.uint8)
    return raw.view(pool_dtype(kv_dtype))


@pytest.mark.parametrize("level", level_params())
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("scale", [0.75, 3.0 * 2.0 ** -20, 1.5e30, 2.0 ** -100])
def test_decodes_every_code_exactly(level: str, kv_dtype: str, scale: float) -> None:
    """The first token sees only itself: its output is its V row, which must be decode(code) * scale
    exactly for every code, normal, subnormal and zero (an E4M3 exponent off by one, or a scale
    ignored, fails here). The products stay normal floats: a process that has loaded a kernel
    built with -ffast-math flushes subnormals on some threads and not others."""
    pool = every_code_pool(kv_dtype, scale)
    q = torch.randn(1, 2, 128)
    got = KERNELS[level](q, pool, 0, torch.zeros(1, dtype=torch.int64), 0)
    want = dequantize_rows(pool[0, 0, 1, 0]).reshape(1, 256)
    assert want.abs().max() > 0
    assert torch.equal(got, want)


@pytest.mark.parametrize("level", level_params())
def test_workspace_holds_float32_tiles(level: str) -> None:
    """An 8-bit pool's tiles are packed as float32 (4 bytes an element), head_dim from the queries."""
    kernel = CpuPrefillKernel.load(level)
    q, pool, ids, k, v = quantized_pool(70, 130, 8, 2, 32, "int8", 16, torch.bfloat16)
    assert_matches(kernel(q, pool, 1, ids, 130), *reference(q, k, v))
    tiles = -(-200 // 32)
    assert kernel._ws.numel() >= 2 * 2 * tiles * 32 * 32 * 4


@pytest.mark.parametrize("level", level_params())
def test_reads_only_its_layer_and_context(level: str) -> None:
    """Other layers, unused blocks and slots past the context may hold anything: the result is unchanged."""
    kernel = KERNELS[level]
    q, pool, ids, _, _ = quantized_pool(20, 30, 9, 3, 64, "fp8", 16, torch.float32)
    want = kernel(q, pool, 1, ids, 30)
    raw = pool.clone().view(torch.uint8)
    raw[:, [0, 2]] = 0x7F                                  # NaN codes (and huge scales)
    unused = torch.ones(raw.shape[0], dtype=torch.bool)
    unused[ids] = False
    raw[unused] = 0x7F
    raw[ids[-1], 1, :, 50 % 16:] = 0x7F                     # the last block's slots past position 49
    assert torch.equal(kernel(q, raw.view(pool.dtype), 1, ids, 30), want)


@pytest.mark.parametrize("level", level_params())
def test_refuses_what_it_cannot_read(level: str) -> None:
    kernel = KERNELS[level]
    q, pool, ids, _, _ = quantized_pool(5, 0, 4, 2, 64, "int8", 16, torch.float32)
    with pytest.raises(ValueError, match="float16 queries"):
        kernel(q.half(), pool, 1, ids, 0)
    with pytest.raises(ValueError, match="head_dim"):
        kernel(q[..., :32].contiguous(), pool, 1, ids, 0)


def test_supports_kv_by_level() -> None:
    """Every SIMD level reads both 8-bit formats; the portable build reads none (and load gives None)."""
    for kernel in KERNELS.values():
        if kernel is not None:
            assert all(kernel.supports_kv(kv) for kv in (None, "int8", "fp8", "fp8_e4m3"))
            assert not kernel.supports_kv("float16")
    lib = build_library("prefill", kernel_source("prefill"), isa="portable")
    if lib is None:
        pytest.skip("no C++ compiler")
    assert CpuPrefillKernel.load("portable") is None
    portable = CpuPrefillKernel(lib, "portable")
    assert portable.supports_kv(None)
    assert not portable.supports_kv("int8") and not portable.supports_kv("fp8")
