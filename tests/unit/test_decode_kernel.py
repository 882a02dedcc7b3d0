"""The C++ decode attention (kvhive.model.decode_kernel) at every ISA level this CPU runs, against a
dense float32 reference over K/V gathered from the pool: GQA groups, ragged contexts spanning
several 256-key chunks, batches sharing prefix blocks, shuffled block tables, strided queries."""

from __future__ import annotations

import pytest
import torch
from support.decode_batches import BlockTables, kernel_at, padded_batch

from kvhive.model import cpu
from kvhive.model.decode_kernel import CpuDecodeKernel

LEVELS = [lvl for lvl in cpu.LEVELS if cpu.detect().supports(lvl)]
# The kernel sums in float32 in another order than the reference; bfloat16 output rounds once more.
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=1e-4, rtol=5e-3)}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
NUM_LAYERS, LAYER = 2, 1
_REFERENCES: dict[tuple, torch.Tensor] = {}      # one per case, shared by the ISA levels


@pytest.fixture(scope="module", params=LEVELS)
def kernel(request) -> CpuDecodeKernel:
    return kernel_at(request.param)


class Pool(BlockTables):
    """A KV pool [blocks, layers, 2, block_size, kv_heads, head_dim] of random values, handing out
    its blocks in a shuffled order (block tables are never contiguous or sorted)."""

    def __init__(self, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.kv = torch.randn(num_blocks, NUM_LAYERS, 2, block_size, kv_heads, head_dim, generator=gen).to(dtype)
        super().__init__(num_blocks, block_size, gen)


def decode(kernel: CpuDecodeKernel, q: torch.Tensor, pool: Pool, tables: list[list[int]],
           lengths: list[int]) -> torch.Tensor:
    """The kernel over a batch whose tables are padded with block 0, as the runner pads them."""
    n, heads, head_dim = q.shape
    return kernel(q, pool.kv, LAYER, padded_batch(kernel, tables, lengths, pool.block_size, heads, head_dim))


def reference(q: torch.Tensor, pool: Pool, tables: list[list[int]], lengths: list[int]) -> torch.Tensor:
    """Dense attention of each sequence's query over its gathered keys and values (computed in
    float64 from the pool's values, returned as float32)."""
    n, heads, head_dim = q.shape
    kv_heads = pool.kv.shape[4]
    group = heads // kv_heads
    out = []
    for i in range(n):
        blocks = pool.kv[torch.tensor(tables[i]), LAYER].double()         # [nb, 2, bs, kv, hd]
        k = blocks[:, 0].reshape(-1, kv_heads, head_dim)[:lengths[i]].transpose(0, 1)   # [kv, len, hd]
        v = blocks[:, 1].reshape(-1, kv_heads, head_dim)[:lengths[i]].transpose(0, 1)
        qg = q[i].double().view(kv_heads, group, head_dim)               # query head h reads kv head h // group
        probs = (qg @ k.transpose(1, 2) * head_dim ** -0.5).softmax(-1)  # [kv, group, len]
        out.append((probs @ v).reshape(-1))
    return torch.stack(out).float()


def cached_reference(case: tuple, q: torch.Tensor, pool: Pool, tables: list[list[int]],
                     lengths: list[int]) -> torch.Tensor:
    """``reference`` once per case (the inputs are seeded, so every level sees the same ones)."""
    if case not in _REFERENCES:
        _REFERENCES[case] = reference(q, pool, tables, lengths)
    return _REFERENCES[case]


def queries(n: int, heads: int, head_dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Query rows as the runner passes them: a strided view into a wider (fused QKV) row."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(n, (heads + 4) * head_dim, generator=gen).to(dtype)
    return wide[:, :heads * head_dim].view(n, heads, head_dim)


def check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, **TOL[dtype])


# (head_dim, heads, kv_heads): SmolLM2 (64, 9, 3), the other groups of the head_dim 64 paths, and
# shapes only the generic path takes.
SHAPES = [(64, 9, 3), (64, 8, 2), (64, 4, 2), (64, 3, 3), (128, 8, 2), (64, 12, 2), (32, 6, 1)]


@DTYPES
@pytest.mark.parametrize("shape", SHAPES, ids=[f"hd{h}-g{q // k}" for h, q, k in SHAPES])
@pytest.mark.parametrize("block_size", [16, 1])
def test_ragged_contexts_over_several_chunks(kernel, dtype, shape, block_size) -> None:
    """One batch of unrelated sequences: contexts inside a block, on block and chunk edges, and
    spanning several 256-key chunks whose partial softmaxes merge."""
    head_dim, heads, kv_heads = shape
    lengths = [1, 5, 16, 17, 255, 256, 257, 700, 1030] if block_size == 16 else [1, 31, 256, 300, 611]
    pool = Pool(sum(-(-n // block_size) for n in lengths) + 8, block_size, kv_heads, head_dim, dtype)
    tables = [pool.table(n) for n in lengths]
    q = queries(len(lengths), heads, head_dim, dtype, seed=block_size)
    want = cached_reference(("ragged", dtype, shape, block_size), q, pool, tables, lengths)
    check(decode(kernel, q, pool, tables, lengths), want, dtype)


@DTYPES
@pytest.mark.parametrize("shape", [(64, 9, 3), (64, 4, 4), (128, 8, 2)], ids=["hd64-g3", "hd64-g1", "hd128-g4"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_sequences_sharing_prefix_blocks(kernel, dtype, shape, block_size) -> None:
    """Sequences whose tables share a cached prefix's blocks: chunks they read from the same blocks
    are one work item (at most 8 sequences each), the rest their own; each has its own query."""
    head_dim, heads, kv_heads = shape
    pool = Pool(4000 // block_size, block_size, kv_heads, head_dim, dtype, seed=block_size)
    prefix = pool.table(600)[:600 // block_size]                  # whole blocks of a 600-token prompt
    shared = len(prefix) * block_size
    lengths = [shared, shared + 1, shared + 9, 600, 650, 1000, 300, 257] + [shared + 40] * 11
    tables = [pool.table(n, prefix if n >= shared else prefix[:-(-n // block_size)]) for n in lengths[:8]]
    tables += [pool.table(shared + 40, prefix)] * 11               # one table: every chunk is shared
    q = queries(len(lengths), heads, head_dim, dtype, seed=3)
    want = cached_reference(("shared", dtype, shape, block_size), q, pool, tables, lengths)
    check(decode(kernel, q, pool, tables, lengths), want, dtype)


@DTYPES
def test_a_lone_sequence_at_many_lengths(kernel, dtype) -> None:
    """SmolLM2's shape, one sequence at a time, every step length tail and chunk boundary nearby."""
    pool = Pool(160, 16, 3, 64, dtype, seed=5)
    table = pool.table(2100)
    for n in (2, 7, 8, 9, 31, 32, 33, 63, 64, 65, 511, 512, 513, 2048, 2100):
        q = queries(1, 9, 64, dtype, seed=n)
        want = cached_reference(("lone", dtype, n), q, pool, [table], [n])
        check(decode(kernel, q, pool, [table[:-(-n // 16)]], [n]), want, dtype)


def test_large_scores_keep_the_softmax_finite(kernel) -> None:
    """Scores of a few hundred, whose exponentials overflow float32: the running maxima rescale."""
    pool = Pool(100, 16, 3, 64, torch.float32, seed=7)
    pool.kv[:, :, 0] *= 40.0                                        # keys 40x: scores ~ 40 * 8 = 320
    lengths = [3, 300, 1200]
    tables = [pool.table(n) for n in lengths]
    q = queries(3, 9, 64, torch.float32, seed=7)
    got = decode(kernel, q, pool, tables, lengths)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, reference(q, pool, tables, lengths), atol=1e-4, rtol=1e-3)


def test_unsupported_shapes_are_refused(kernel) -> None:
    pool = Pool(4, 16, 1, 320, torch.float32)
    with pytest.raises(ValueError, match="unsupported shape"):
        decode(kernel, queries(1, 1, 320, torch.float32, seed=0), pool, [pool.table(5)], [5])
