"""The C++ decode attention (kvhive.model.decode_kernel) over packed 8-bit KV pools (int8 and float8
E4M3 rows with a bfloat16 scale, kvhive.model.kv_quant), at every ISA level this CPU runs, against a
float64 reference over ``dequantize_rows(pool)``: float32 and bfloat16 queries, the head_dim 64
paths (groups 1-4) and the generic one (head_dim 128, 96, 80, 36; group 8), ragged contexts on block and
chunk edges, padded block tables, sequences sharing prefix blocks, rows of scale 0, extreme scales.

Dequantised values are exact in float32, so float32 queries match the reference as closely as the
float pools' kernel does (tests/unit/test_decode_kernel.py's tolerances); bfloat16 output within its
rounding."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch
from support.decode_batches import BlockTables, kernel_at, padded_batch

from kvhive.model import cpu
from kvhive.model.decode_kernel import CpuDecodeKernel
from kvhive.model.kv_quant import SCALE_BYTES, dequantize_rows, quantize_rows

LEVELS = [lvl for lvl in cpu.LEVELS if cpu.detect().supports(lvl)]
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=1e-4, rtol=5e-3)}
QDTYPES = pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16], ids=["q32", "qbf16"])
KV_DTYPES = pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
NUM_LAYERS, LAYER, BLOCK = 2, 1, 16
CHUNK = CpuDecodeKernel.chunk_keys(BLOCK)


@pytest.fixture(scope="module", params=LEVELS)
def kernel(request) -> CpuDecodeKernel:
    return kernel_at(request.param)


class PackedPool(BlockTables):
    """A packed 8-bit pool [blocks, layers, 2, BLOCK, kv_heads, head_dim + 2] of random values whose
    rows have different magnitudes (so different scales), some rows all zero (scale 0), and its
    blocks handed out in a shuffled order."""

    def __init__(self, num_blocks: int, kv_heads: int, head_dim: int, kv_dtype: str, seed: int = 0,
                 k_factor: float = 1.0, v_factor: float = 1.0) -> None:
        gen = torch.Generator().manual_seed(seed)
        shape = (num_blocks, NUM_LAYERS, 2, BLOCK, kv_heads)
        values = torch.randn(*shape, head_dim, generator=gen) * torch.exp(torch.randn(*shape, 1, generator=gen))
        values[:, :, 0] *= k_factor
        values[:, :, 1] *= v_factor
        values[torch.rand(*shape, generator=gen) < 0.05] = 0.0          # rows of scale 0
        self.kv = quantize_rows(values, kv_dtype)
        self.values = dequantize_rows(self.kv).double()                # exactly what the kernel reads
        super().__init__(num_blocks, BLOCK, gen)


def decode(kernel: CpuDecodeKernel, q: torch.Tensor, pool: PackedPool, tables: list[list[int]],
           lengths: list[int]) -> torch.Tensor:
    """The kernel over a batch whose tables are padded (two entries past the longest) with block 0."""
    n, heads, head_dim = q.shape
    return kernel(q, pool.kv, LAYER, padded_batch(kernel, tables, lengths, BLOCK, heads, head_dim, padding=2))


def reference(q: torch.Tensor, values: torch.Tensor, tables: list[list[int]], lengths: list[int]) -> torch.Tensor:
    """Dense float64 attention of each query over its keys and values, gathered from ``values``
    ([blocks, layers, 2, BLOCK, kv_heads, head_dim], the pool dequantised)."""
    n, heads, head_dim = q.shape
    kv_heads = values.shape[4]
    out = []
    for i in range(n):
        blocks = values[torch.tensor(tables[i]), LAYER]                          # [nb, 2, bs, kv, hd]
        k = blocks[:, 0].reshape(-1, kv_heads, head_dim)[:lengths[i]].transpose(0, 1)
        v = blocks[:, 1].reshape(-1, kv_heads, head_dim)[:lengths[i]].transpose(0, 1)
        qg = q[i].double().view(kv_heads, heads // kv_heads, head_dim)
        probs = (qg @ k.transpose(1, 2) * head_dim ** -0.5).softmax(-1)
        out.append((probs @ v).reshape(-1))
    return torch.stack(out)


def queries(n: int, heads: int, head_dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Query rows as the runner passes them: a strided view into a wider (fused QKV) row."""
    wide = torch.randn(n, (heads + 4) * head_dim, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return wide[:, :heads * head_dim].view(n, heads, head_dim)


def check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, unit: float = 1.0, **tol: float) -> None:
    assert got.dtype == dtype
    torch.testing.assert_close(got.double() / unit, want / unit, **(tol or TOL[dtype]), check_dtype=False)


@dataclass(frozen=True)
class Case:
    """A seeded batch and its reference, built once and shared by the ISA levels."""

    pool: PackedPool
    tables: list[list[int]]
    lengths: list[int]
    q: torch.Tensor
    want: torch.Tensor

    def run(self, kernel: CpuDecodeKernel, qdtype: torch.dtype) -> None:
        check(decode(kernel, self.q, self.pool, self.tables, self.lengths), self.want, qdtype)


# (head_dim, heads, kv_heads): the head_dim 64 paths' groups 1-4 (SmolLM2 is 64, 9, 3), and shapes
# only the generic path takes: head_dim 128, odd head_dims (36: not a multiple of 8), group 8.
SHAPES = [(64, 4, 4), (64, 8, 4), (64, 9, 3), (64, 8, 2), (128, 8, 2), (96, 6, 2), (80, 8, 1), (64, 16, 2),
          (36, 4, 2)]
LENGTHS = [1, 15, 16, 17, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 37]


@KV_DTYPES
@QDTYPES
@pytest.mark.parametrize("shape", SHAPES, ids=[f"hd{h}-g{q // k}" for h, q, k in SHAPES])
def test_ragged_contexts_match_the_dequantised_reference(kernel, kv_dtype, qdtype, shape) -> None:
    """One batch of unrelated sequences: contexts of one key, inside and on block edges, on and
    past a chunk's edge, and over several chunks whose partial softmaxes merge."""
    ragged_case(kv_dtype, qdtype, shape).run(kernel, qdtype)


@functools.cache
def ragged_case(kv_dtype: str, qdtype: torch.dtype, shape: tuple[int, int, int]) -> Case:
    head_dim, heads, kv_heads = shape
    pool = PackedPool(sum(-(-n // BLOCK) for n in LENGTHS) + 4, kv_heads, head_dim, kv_dtype, seed=head_dim)
    tables = [pool.table(n) for n in LENGTHS]
    q = queries(len(LENGTHS), heads, head_dim, qdtype, seed=heads)
    return Case(pool, tables, LENGTHS, q, reference(q, pool.values, tables, LENGTHS))


@KV_DTYPES
@QDTYPES
@pytest.mark.parametrize("shape", [(64, 9, 3), (64, 4, 4), (128, 8, 2), (96, 6, 2)],
                         ids=["hd64-g3", "hd64-g1", "hd128-g4", "hd96-g3"])
def test_sequences_sharing_prefix_blocks(kernel, kv_dtype, qdtype, shape) -> None:
    """Sequences whose tables share a cached prefix's blocks: the chunks they read from the same
    blocks are one work item (up to 8 sequences), each with its own query."""
    shared_case(kv_dtype, qdtype, shape).run(kernel, qdtype)


@functools.cache
def shared_case(kv_dtype: str, qdtype: torch.dtype, shape: tuple[int, int, int]) -> Case:
    head_dim, heads, kv_heads = shape
    pool = PackedPool(100, kv_heads, head_dim, kv_dtype, seed=7)
    prefix = pool.table(600)[:600 // BLOCK]
    shared = len(prefix) * BLOCK
    lengths = [shared, shared + 1, shared + 9, 600, 257, CHUNK] + [shared + 40] * 10
    tables = [pool.table(n, prefix if n >= shared else prefix[:-(-n // BLOCK)]) for n in lengths[:6]]
    tables += [pool.table(shared + 40, prefix)] * 10
    q = queries(len(lengths), heads, head_dim, qdtype, seed=3)
    return Case(pool, tables, lengths, q, reference(q, pool.values, tables, lengths))


@KV_DTYPES
@pytest.mark.parametrize("k_factor,v_factor", [(1e-30, 1e30), (30.0, 1e-30)], ids=["tiny-k", "tiny-v"])
@pytest.mark.parametrize("head_dim", [64, 96])
def test_extreme_scales(kernel, kv_dtype, k_factor, v_factor, head_dim) -> None:
    """Row scales near 1e-32 and 1e28: scores from tiny keys (a flat softmax) and from large ones
    (a sharp one, scores in the thousands, whose float32 rounding the large-score tolerance of
    test_decode_kernel.py allows), values tiny or huge; compared relative to their size."""
    pool = PackedPool(80, 3, head_dim, kv_dtype, seed=11, k_factor=k_factor, v_factor=v_factor)
    lengths = [1, 33, 300, 700]
    tables = [pool.table(n) for n in lengths]
    q = queries(len(lengths), 9, head_dim, torch.float32, seed=5)
    got = decode(kernel, q, pool, tables, lengths)
    assert torch.isfinite(got).all()
    tol = dict(atol=1e-4, rtol=1e-3) if k_factor > 1 else {}
    check(got, reference(q, pool.values, tables, lengths), torch.float32, unit=v_factor, **tol)


@KV_DTYPES
@QDTYPES
def test_an_all_zero_context_gives_zero(kernel, kv_dtype, qdtype) -> None:
    """Every row of scale 0: a uniform softmax over zero values."""
    pool = PackedPool(40, 3, 64, kv_dtype)
    pool.kv.zero_()
    lengths = [1, 40, 300]
    tables = [pool.table(n) for n in lengths]
    got = decode(kernel, queries(3, 9, 64, qdtype, seed=1), pool, tables, lengths)
    assert torch.equal(got.float(), torch.zeros(3, 9 * 64))


def wrong_values(pool: PackedPool, kv_dtype: str, mistake: str) -> torch.Tensor:
    """The pool's values as a kernel with one mistake would read them."""
    raw = pool.kv.view(torch.uint8)
    codes = raw[..., :-SCALE_BYTES].view(pool.kv.dtype).double()
    if mistake == "scale ignored":
        return codes
    if mistake == "exponent off by one":
        return pool.values * 2
    k_only = pool.values.clone()                                    # V rows read with K's scales
    k_only[:, :, 1] = codes[:, :, 1] * raw[:, :, 0, ..., -SCALE_BYTES:].contiguous().view(torch.bfloat16).double()
    return k_only


@pytest.mark.parametrize("kv_dtype,mistake", [("int8", "scale ignored"), ("int8", "K scale for V"),
                                              ("fp8", "scale ignored"), ("fp8", "exponent off by one"),
                                              ("fp8", "K scale for V")])
def test_the_reference_tells_a_wrong_dequantisation(kernel, kv_dtype, mistake) -> None:
    """The checks above can fail: references of a mistaken dequantisation are far outside the
    tolerance of the kernel's output, which matches the right one."""
    pool = PackedPool(60, 3, 64, kv_dtype, seed=2)
    lengths = [5, 300, 600]
    tables = [pool.table(n) for n in lengths]
    q = queries(3, 9, 64, torch.float32, seed=2)
    got = decode(kernel, q, pool, tables, lengths)
    check(got, reference(q, pool.values, tables, lengths), torch.float32)
    wrong = reference(q, wrong_values(pool, kv_dtype, mistake), tables, lengths)
    assert not torch.allclose(got.double(), wrong, **TOL[torch.float32])


def test_8bit_pools_are_supported_and_mismatched_pools_refused(kernel) -> None:
    assert kernel.supports_kv("int8") and kernel.supports_kv("fp8") and kernel.supports_kv(None)
    pool = PackedPool(8, 1, 64, "int8")
    q = queries(1, 2, 64, torch.float32, seed=0)
    with pytest.raises(ValueError, match="cannot read"):                  # rows of another head_dim
        decode(kernel, queries(1, 2, 62, torch.float32, seed=0), pool, [pool.table(5)], [5])
    pool.kv = torch.zeros(8, NUM_LAYERS, 2, BLOCK, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cannot read"):                  # a float pool of another type
        decode(kernel, q, pool, [pool.table(5)], [5])
