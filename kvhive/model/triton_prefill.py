"""Prefill / extend attention in Triton, reading K/V from the paged pool through the block table.

A chunk of ``n`` new tokens at positions ``start_pos..start_pos+n-1`` attends causally to its whole
context (the cached prefix and itself). Nothing is gathered or copied: each key tile's pool rows
are found by looking its positions up in the chunk's row of block ids, so a key tile may cover part
of a pool block, one block or several, and the block size need not divide the tile.

Tiling (flash-attention style): one program per (query tile, chunk, KV head). A query tile holds
``block_m`` tokens times the group of query heads that share the KV head (padded to a power of
two), so each K/V tile is read once for the whole group. Scores and the running softmax stay in
float32 (``exp2`` with log2(e) folded into the scale); the output is written in the pool's dtype.
Key tiles that lie wholly before the tile's first query position are read with no mask at all;
only the diagonal tiles (keys at the tile's own positions) mask the causal triangle. With a
sliding window (key j visible to the query at position p when p - window < j <= p) tiles wholly
before every query's window are skipped and the window mask is applied to the rest.

One launch serves every prefill chunk of a step (``VarlenPrefill``: cu_seqlens-style row
offsets, start positions and a padded table of block ids); query tiles past a chunk's end exit at
once. Float32 pools use IEEE float32 dot products; 16-bit pools multiply in their own dtype with
float32 sums (on CPU under ``TRITON_INTERPRET=1`` tiles are widened to float32 first).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvhive.model.attention import PrefillSpan
from kvhive.model.window_attention import ScoreRule

logger = logging.getLogger(__name__)

LOG2E = 1.4426950408889634
# Span tuples whose launch inputs are kept: a step's main pool, window pool and restricted last layer.
PLANS_KEPT = 3


@triton.jit
def _attend_keys(acc, m_i, l_i, q, qpos, k0, hi, table_row, k_base, v_base, stride_block, stride_pos,
                 scale_log2, softcap, window, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, DIAGONAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                 HAS_WINDOW: tl.constexpr, F32_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """One key tile [k0, k0 + BLOCK_N) folded into the running softmax (acc, m_i, l_i).
    DIAGONAL: the tile reaches the queries' own positions (causal mask, keys >= hi masked)."""
    keys = k0 + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    if DIAGONAL:
        key_ok = keys < hi
        blocks = tl.load(table_row + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
    else:
        blocks = tl.load(table_row + keys // BLOCK_SIZE).to(tl.int64)
    rows = blocks * stride_block + (keys % BLOCK_SIZE).to(tl.int64) * stride_pos
    offs = rows[:, None] + dims[None, :]
    if DIAGONAL:
        k = tl.load(k_base + offs, mask=key_ok[:, None], other=0.0)
        v = tl.load(v_base + offs, mask=key_ok[:, None], other=0.0)
    else:
        k = tl.load(k_base + offs)
        v = tl.load(v_base + offs)
    if F32_DOT:
        k, v = k.to(tl.float32), v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if HAS_SOFTCAP:
        # cap * tanh(x / cap) with tanh(y) = 1 - 2 / (exp(2y) + 1); x is the scaled score.
        s = (1.0 - 2.0 / (tl.exp(s * (2.0 * scale_log2 / (softcap * 1.4426950408889634))) + 1.0)) * (
            softcap * 1.4426950408889634)
    else:
        s = s * scale_log2
    if DIAGONAL:
        s = tl.where((keys[None, :] <= qpos[:, None]) & key_ok[None, :], s, float("-inf"))
    if HAS_WINDOW:
        s = tl.where(keys[None, :] > qpos[:, None] - window, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)       # rows that saw no key yet
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attend_tile(q_ptr, kv_ptr, out_ptr, table_row, row0, n, start, first, kvh, stride_qt, stride_qh, stride_ot,
                 stride_block, stride_pos, stride_head, kv_layer, stride_kv, scale_log2, softcap, window,
                 GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                 HAS_WINDOW: tl.constexpr, F32_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """Queries first..first+BLOCK_M-1 of one chunk, every query head of KV head ``kvh``."""
    r = tl.arange(0, BLOCK_M * GROUP_PAD)
    t, g = first + r // GROUP_PAD, r % GROUP_PAD       # row r: token t of the chunk, head g of the group
    ok = (t < n) & (g < GROUP)
    head = kvh * GROUP + g
    dims = tl.arange(0, HEAD_DIM)
    q_offs = (row0 + t)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=ok[:, None], other=0.0)
    if F32_DOT:
        q = q.to(tl.float32)
    qpos = start + t
    hi = start + tl.minimum(first + BLOCK_M, n)          # keys < hi: the tile's last query and before
    diag = start + first                                  # keys < diag: seen by every query of the tile
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(diag - window + 1, 0)             # keys before lo: outside every query's window
    k_base = kv_ptr + kv_layer + kvh.to(tl.int64) * stride_head
    v_base = k_base + stride_kv
    m_i = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M * GROUP_PAD], 0.0, tl.float32)
    acc = tl.full([BLOCK_M * GROUP_PAD, HEAD_DIM], 0.0, tl.float32)
    full_end = lo + (diag - lo) // BLOCK_N * BLOCK_N
    for k0 in range(lo, full_end, BLOCK_N):               # the prefix's whole tiles: no mask
        acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, qpos, k0, hi, table_row, k_base, v_base, stride_block,
                                     stride_pos, scale_log2, softcap, window, BLOCK_N, HEAD_DIM, BLOCK_SIZE,
                                     False, HAS_SOFTCAP, HAS_WINDOW, F32_DOT, PRECISION)
    for k0 in range(full_end, hi, BLOCK_N):               # the diagonal tiles: causal mask
        acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, qpos, k0, hi, table_row, k_base, v_base, stride_block,
                                     stride_pos, scale_log2, softcap, window, BLOCK_N, HEAD_DIM, BLOCK_SIZE,
                                     True, HAS_SOFTCAP, HAS_WINDOW, F32_DOT, PRECISION)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_offs = (row0 + t)[:, None].to(tl.int64) * stride_ot + head[:, None] * HEAD_DIM + dims[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=ok[:, None])


@triton.jit
def _prefill_varlen_kernel(q_ptr, kv_ptr, out_ptr, table_ptr, cu_ptr, start_ptr, stride_qt, stride_qh, stride_ot,
                           stride_table, stride_block, stride_pos, stride_head, kv_layer, stride_kv,
                           scale_log2, softcap, window, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                           BLOCK_SIZE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr,
                           F32_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """Grid (query tile, chunk, KV head); a tile past its chunk's end does nothing."""
    tile, seq, kvh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row0 = tl.load(cu_ptr + seq)
    n = tl.load(cu_ptr + seq + 1) - row0
    first = tile * BLOCK_M
    if first < n:
        start = tl.load(start_ptr + seq)
        table_row = table_ptr + seq.to(tl.int64) * stride_table
        _attend_tile(q_ptr, kv_ptr, out_ptr, table_row, row0, n, start, first, kvh, stride_qt, stride_qh,
                     stride_ot, stride_block, stride_pos, stride_head, kv_layer, stride_kv, scale_log2, softcap,
                     window, GROUP, GROUP_PAD, BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_SIZE, HAS_SOFTCAP, HAS_WINDOW,
                     F32_DOT, PRECISION)


@dataclass(frozen=True)
class VarlenPrefill:
    """Several prefill chunks of one step as the inputs of one launch (all on the pool's device)."""

    cu_seqlens: torch.Tensor        # [chunks + 1] int32: chunk s is rows cu[s]..cu[s+1]-1 of q
    start_pos: torch.Tensor         # [chunks] int32: position of each chunk's first token
    block_tables: torch.Tensor      # [chunks, max blocks] int64; padding is block 0, never read
    max_len: int                    # new tokens of the longest chunk
    num_rows: int                   # query rows of all chunks together


def varlen_prefill(lengths: Sequence[int], start_pos: Sequence[int], block_ids: Sequence[torch.Tensor],
                   block_size: int, device: torch.device) -> VarlenPrefill:
    """The launch inputs of chunks with ``lengths`` new tokens at ``start_pos``, whose contexts live in
    pool blocks ``block_ids`` (one int tensor each, on ``device``); ValueError where a table is too short."""
    if not lengths or len({len(lengths), len(start_pos), len(block_ids)}) != 1:
        raise ValueError("varlen prefill: one length, start position and block table per chunk, at least one")
    for n, start, ids in zip(lengths, start_pos, block_ids, strict=True):
        if n < 1 or start < 0 or ids.numel() * block_size < start + n:
            raise ValueError(f"varlen prefill: {ids.numel()} blocks of {block_size} cannot hold "
                             f"{start} cached + {n} new tokens")
    # One padding copy on the device (no host round trip of the tables).
    tables = torch.nn.utils.rnn.pad_sequence([ids.view(-1).to(device, torch.int64) for ids in block_ids],
                                             batch_first=True)
    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return VarlenPrefill(cu.to(device), torch.tensor(list(start_pos), dtype=torch.int32).to(device),
                         tables, max(lengths), int(cu[-1]))


class TritonPrefillKernel:
    """Causal prefill attention of one or several chunks straight from the pool (float32, bfloat16 and
    float16 pools; head_dim a power of two from 16 to 256; up to 16 query heads per KV head)."""

    HEAD_DIMS = (16, 32, 64, 128, 256)
    DTYPES = (torch.float32, torch.bfloat16, torch.float16)
    MAX_GROUP = 16
    takes_score_rules = True        # scale, soft-cap and window per call (``ScoreRule``)

    def __init__(self, device: torch.device | None = None, rows: int | None = None, block_n: int | None = None,
                 num_warps: int | None = None) -> None:
        """``device``: where it runs (None: CPU, under TRITON_INTERPRET=1); ``rows``: query rows
        (tokens x padded group) per tile; ``block_n``: keys per tile; None: by head_dim (smaller
        tiles for wider heads, so the float32 accumulator fits the registers)."""
        for name, value in (("rows", rows), ("block_n", block_n)):
            if value is not None and (value < 16 or value & (value - 1)):
                raise ValueError(f"prefill kernel: {name} must be a power of two of at least 16, got {value}")
        self.device = device or torch.device("cpu")
        self.rows, self.block_n, self.num_warps = rows, block_n, num_warps
        self._launched: dict[tuple[torch.dtype, int, int], bool] = {}    # ``launches``' answers
        # The launch inputs of the latest span tuples attended, newest last: a step's every layer
        # reuses its tuple (the main pool's, the window pool's, the restricted last layer's).
        self._plans: list[tuple[tuple[PrefillSpan, ...], VarlenPrefill]] = []

    @classmethod
    def load(cls, device: torch.device) -> TritonPrefillKernel | None:
        """The kernel where it compiles and runs on ``device`` (one tiny launch, checked against
        torch); None with a log line otherwise (no driver, a CPU without TRITON_INTERPRET=1)."""
        kernel = cls(device=device)
        return kernel if kernel.launches(torch.float32, 2, 16) else None

    def describe(self, device: torch.device) -> str:
        """The path's name for the runner's startup log and /version."""
        return f"Triton paged ({device.type})"

    def supports(self, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        """True where this kernel runs a model of these shapes and pool dtype on its device: the shape
        within its limits, and a tiny launch of that configuration right (``launches``)."""
        return (self.within_limits(dtype, num_heads, num_kv_heads, head_dim)
                and self.launches(dtype, num_heads // num_kv_heads, head_dim))

    def within_limits(self, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        """Whether the shape and dtype are within the kernel's limits (no launch)."""
        return (dtype in self.DTYPES and head_dim in self.HEAD_DIMS and num_kv_heads > 0
                and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= self.MAX_GROUP)

    def launches(self, dtype: torch.dtype, group: int, head_dim: int) -> bool:
        """Whether one tiny launch (5 new tokens over 20 cached, ``group`` query heads on one KV head)
        compiles, runs and matches torch on this kernel's device; remembered per configuration.
        False with a log line where it does not (no driver, a GPU short of shared memory)."""
        key = (dtype, group, head_dim)
        if key not in self._launched:
            self._launched[key] = _launch_check(self, self.device, dtype, group, head_dim)
        return self._launched[key]

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_ids: torch.Tensor,
                 start_pos: int, rule: ScoreRule | None = None) -> torch.Tensor:
        """Attention of one chunk q [n, heads, head_dim] (rows may be strided) at positions start_pos...
        over the pool blocks ``block_ids`` (positions 0..start_pos+n-1, the chunk's own K/V already
        written) -> [n, heads * head_dim]. ``rule``: scale, soft-cap, window (None: 1/sqrt(head_dim))."""
        batch = varlen_prefill([q.shape[0]], [start_pos], [block_ids], kv_cache.shape[3], kv_cache.device)
        return self.attend_varlen(q, kv_cache, layer, batch, rule)

    def attend_spans(self, q: torch.Tensor, kv_cache: torch.Tensor, layer: int, spans: tuple[PrefillSpan, ...],
                     rule: ScoreRule | None = None) -> list[torch.Tensor]:
        """Every prefill span of a step in one launch: q is the step's [T, heads, head_dim], the spans
        contiguous rows of it with their block ids set -> one part, [rows of the spans, heads * head_dim]
        ([] without spans)."""
        if not spans:
            return []
        batch = next((b for known, b in self._plans if known is spans), None)
        if batch is None:
            if any(s.block_ids is None for s in spans) or any(
                    a.end != b.begin for a, b in zip(spans, spans[1:], strict=False)):
                raise ValueError("prefill kernel: spans must be contiguous rows with block ids")
            batch = varlen_prefill([s.end - s.begin for s in spans], [s.start_pos for s in spans],
                                   [s.block_ids for s in spans], kv_cache.shape[3], kv_cache.device)
            self._plans = [*self._plans[-(PLANS_KEPT - 1):], (spans, batch)]
        return [self.attend_varlen(q[spans[0].begin:spans[-1].end], kv_cache, layer, batch, rule)]

    def attend_varlen(self, q: torch.Tensor, kv_cache: torch.Tensor, layer: int, batch: VarlenPrefill,
                      rule: ScoreRule | None = None) -> torch.Tensor:
        """The chunks of ``batch`` (rows of q [rows, heads, head_dim] per ``batch.cu_seqlens``) in one
        launch -> [rows, heads * head_dim] in the pool's dtype."""
        rows, heads, head_dim = q.shape
        _, _, _, block_size, kv_heads, _ = kv_cache.shape
        if q.dtype != kv_cache.dtype or q.stride(2) != 1 or kv_cache.stride(5) != 1:
            raise ValueError("prefill kernel: q must match the pool's dtype, with contiguous head dims")
        if rows != batch.num_rows or not self.within_limits(q.dtype, heads, kv_heads, head_dim):
            raise ValueError(f"prefill kernel: unsupported shape ({rows} rows for {batch.num_rows}, "
                             f"{heads} heads on {kv_heads} KV heads of {head_dim}, {q.dtype})")
        rule = rule or ScoreRule(head_dim ** -0.5)
        group = heads // kv_heads
        group_pad = triton.next_power_of_2(group)
        tile_rows, block_n, warps = self._tiles(head_dim)
        block_m = max(1, tile_rows // group_pad)
        out = torch.empty(rows, heads * head_dim, dtype=q.dtype, device=q.device)
        grid = (triton.cdiv(batch.max_len, block_m), batch.cu_seqlens.shape[0] - 1, kv_heads)
        s = kv_cache.stride()
        _prefill_varlen_kernel[grid](
            q, kv_cache, out, batch.block_tables, batch.cu_seqlens, batch.start_pos, q.stride(0), q.stride(1),
            out.stride(0), batch.block_tables.stride(0), s[0], s[3], s[4], layer * s[1], s[2],
            rule.scale * LOG2E, rule.softcap or 1.0, rule.window or 0, GROUP=group, GROUP_PAD=group_pad,
            BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
            HAS_SOFTCAP=rule.softcap is not None, HAS_WINDOW=rule.window is not None,
            F32_DOT=q.device.type == "cpu", PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=warps)
        return out

    def _tiles(self, head_dim: int) -> tuple[int, int, int]:
        """(query rows, keys, warps) per tile for this head size."""
        rows = self.rows or (128 if head_dim <= 128 else 64)
        block_n = self.block_n or (64 if head_dim <= 64 else 32)
        return rows, block_n, self.num_warps or (4 if head_dim <= 64 else 8)


def _launch_check(kernel: TritonPrefillKernel, device: torch.device, dtype: torch.dtype, group: int,
                  head_dim: int) -> bool:
    """One tiny launch of this configuration against torch (float32 softmax); False, logged, where it
    fails to compile or run, or is wrong."""
    gen = torch.Generator().manual_seed(0)
    what = f"Triton prefill kernel ({dtype}, {group} query heads per KV head of {head_dim})"
    try:
        pool = torch.randn(3, 1, 2, 16, 1, head_dim, generator=gen).to(device, dtype)
        q = torch.randn(5, group, head_dim, generator=gen).to(device, dtype)
        ids = torch.tensor([2, 0], dtype=torch.int64, device=device)
        got = kernel(q, pool, 0, ids, 20)
    except Exception as exc:  # noqa: BLE001 - any compile or launch failure means: not here
        logger.info("%s cannot run on %s: %s", what, device, exc)
        return False
    k, v = (pool[:, 0, i].index_select(0, ids).flatten(0, 1)[:25].float().expand(25, group, head_dim) for i in (0, 1))
    seen = torch.ones(5, 25, dtype=torch.bool, device=device).tril(20)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k).mul(head_dim ** -0.5).masked_fill(~seen, float("-inf"))
    want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(5, group * head_dim)
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    if not torch.allclose(got.float(), want, atol=tol, rtol=tol):
        logger.warning("%s gives wrong results on %s; not used", what, device)
        return False
    return True
