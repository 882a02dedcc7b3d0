"""Decode attention read through the block table in place by a Triton flash-decoding kernel (CUDA).

One program per (decode row, KV head, context partition of ``partition_keys`` keys): it loads the
queries of the KV head's whole GQA group once, walks its partition ``BLOCK_N`` keys at a time (each
key's pool block looked up in the row's table, so nothing is gathered or copied), and keeps an
online softmax in float32. With one partition the program writes the normalised output; with more,
each leaves (max, sum, unnormalised output) and a second kernel merges a row's partitions by their
maxima. The grid and the partials depend only on (rows, table width), never on context values, and
nothing syncs with the host: a CUDA graph records the launches as they are.

Score options (the window layers of ``kvhive.model.window_attention``): a scale (default
1/sqrt(head_dim)), a soft-cap (``cap * tanh(score / cap)``), a sliding window (the query at
position p sees key j when p - window < j <= p) and per-row first-key positions (row i's table
starts at position ``first_keys[i]``).

Triton is imported here only; on CPU the kernels run under ``TRITON_INTERPRET=1`` (which must be set
before this module is imported), which the tests use to check them against torch.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from kvhive.model.attention import DecodeBatch

logger = logging.getLogger(__name__)

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256


@triton.jit
def _visible_span(ctx_ptr, first_ptr, row, part, window, HAS_FIRST: tl.constexpr, HAS_WINDOW: tl.constexpr,
                  PART_KEYS: tl.constexpr):
    """[start, stop): the table indices of partition ``part`` that row ``row``'s query sees."""
    # Table index t holds position first + t; the row's query sits at position ctx - 1.
    pos = tl.load(ctx_ptr + row) - 1
    first = 0
    if HAS_FIRST:
        first = tl.load(first_ptr + row)
    hi = pos - first + 1                                  # table indices [lo, hi) are visible
    lo = hi * 0
    if HAS_WINDOW:
        lo = tl.maximum(lo, pos - window + 1 - first)
    return tl.maximum(lo, part * PART_KEYS), tl.minimum(hi, (part + 1) * PART_KEYS)


@triton.jit
def _scores(q, k, seen, qk_scale, softcap, HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr):
    """[group, keys] scores of q against k in the log2 domain (-inf where not ``seen``)."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if HAS_SOFTCAP:                                       # cap * tanh(s / cap), tanh by the sigmoid
        s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
    return tl.where(seen[None, :], s * 1.4426950408889634, float("-inf"))


@triton.jit
def _decode_partition(q_ptr, pool_ptr, tables_ptr, ctx_ptr, first_ptr, out_ptr, m_ptr, l_ptr, acc_ptr,
                      layer, max_blocks, block_size, head_dim, group, qk_scale, softcap, window,
                      q_s0, q_s1, s_block, s_layer, s_kv, s_slot, s_head, num_heads, num_parts,
                      HAS_FIRST: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                      SINGLE: tl.constexpr, PART_KEYS: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                      PRECISION: tl.constexpr):
    """One (row, KV head, partition): online softmax over the partition's visible keys."""
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_ok = offs_g < group
    d_ok = offs_d < head_dim
    heads = kvh * group + offs_g
    q = tl.load(q_ptr + row.to(tl.int64) * q_s0 + heads[:, None] * q_s1 + offs_d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    start, stop = _visible_span(ctx_ptr, first_ptr, row, part, window, HAS_FIRST, HAS_WINDOW, PART_KEYS)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    layer_base = pool_ptr + layer * s_layer + kvh * s_head       # small: int32 is enough
    # Tiles start on BLOCK_N boundaries inside the partition: each holds at least one visible key.
    for tile in range((start // BLOCK_N) * BLOCK_N, stop, BLOCK_N):
        t = tile + tl.arange(0, BLOCK_N)
        seen = (t >= start) & (t < stop)
        block = tl.load(tables_ptr + row.to(tl.int64) * max_blocks + t // block_size,
                        mask=seen, other=0)
        rows = block * s_block + (t % block_size) * s_slot
        kv_mask = seen[:, None] & d_ok[None, :]
        k = tl.load(layer_base + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        s = _scores(q, k, seen, qk_scale, softcap, HAS_SOFTCAP, PRECISION)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        v = tl.load(layer_base + s_kv + rows[:, None] + offs_d[None, :], mask=kv_mask,
                    other=0.0).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new
    if SINGLE:
        o = acc / l_i[:, None]
        tl.store(out_ptr + row.to(tl.int64) * num_heads * head_dim + heads[:, None] * head_dim + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    else:
        slot = (row.to(tl.int64) * num_heads + heads) * num_parts + part
        tl.store(m_ptr + slot, m_i, mask=g_ok)
        tl.store(l_ptr + slot, l_i, mask=g_ok)
        tl.store(acc_ptr + slot[:, None] * BLOCK_D + offs_d[None, :], acc, mask=g_ok[:, None])


@triton.jit
def _merge_partitions(out_ptr, m_ptr, l_ptr, acc_ptr, head_dim, num_heads, num_parts,
                      BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    """One (row, head): the partitions' partial softmaxes merged by their maxima."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    base = (row.to(tl.int64) * num_heads + head) * num_parts
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    m_max = tl.full([BLOCK_P], float("-inf"), tl.float32)
    for p0 in range(0, num_parts, BLOCK_P):
        m_max = tl.maximum(m_max, tl.load(m_ptr + base + p0 + offs_p, mask=p0 + offs_p < num_parts,
                                          other=float("-inf")))
    m_all = tl.max(m_max, 0)                  # finite: the query's own key lies in some partition
    total = tl.zeros([BLOCK_P], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for p0 in range(0, num_parts, BLOCK_P):
        ok = p0 + offs_p < num_parts
        m = tl.load(m_ptr + base + p0 + offs_p, mask=ok, other=float("-inf"))
        w = tl.where(m > float("-inf"), tl.exp2(m - m_all), 0.0)
        total += w * tl.load(l_ptr + base + p0 + offs_p, mask=ok, other=0.0)
        part = tl.load(acc_ptr + (base + p0 + offs_p)[:, None] * BLOCK_D + offs_d[None, :], mask=ok[:, None],
                       other=0.0)
        acc += tl.sum(w[:, None] * part, 0)
    o = acc / tl.sum(total, 0)
    tl.store(out_ptr + (row.to(tl.int64) * num_heads + head) * head_dim + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=offs_d < head_dim)


class TritonDecodeKernel:
    """Paged decode attention on CUDA (or the Triton interpreter on CPU): float32, bfloat16 and
    float16 pools, any head_dim up to 256 (padded to a power of two), any GQA group and block size.

    ``partition_keys``: keys per program (a multiple of ``block_keys``); ``block_keys``: keys per
    inner step. Both powers of two, at least 16 (``tl.dot``'s smallest tile).
    """

    def __init__(self, partition_keys: int = 512, block_keys: int = 64) -> None:
        if block_keys < 16 or block_keys & (block_keys - 1) or partition_keys % block_keys:
            raise ValueError(f"block_keys {block_keys} must be a power of two >= 16 dividing "
                             f"partition_keys {partition_keys}")
        self.partition_keys = partition_keys
        self.block_keys = block_keys

    @classmethod
    def load(cls, device: torch.device | str) -> TritonDecodeKernel | None:
        """The kernel once a tiny launch on ``device`` has compiled and matched torch; None (logged)
        where it cannot run there."""
        kernel = cls()
        try:
            ok = kernel.self_check(torch.device(device))
        except Exception as exc:  # noqa: BLE001 - any compile or launch failure means: not here
            logger.warning("Triton decode kernel cannot run on %s: %s: %s", device, type(exc).__name__, exc)
            return None
        if not ok:
            logger.warning("Triton decode kernel gives wrong values on %s", device)
            return None
        return kernel

    @staticmethod
    def supports(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        """Whether the kernel runs this pool dtype and head shape."""
        return (dtype in _DTYPES and 0 < head_dim <= MAX_HEAD_DIM and num_kv_heads > 0
                and num_heads % num_kv_heads == 0)

    def describe(self, device: torch.device) -> str:
        """The path's name for the runner's startup log and /version."""
        return f"Triton paged ({device.type})"

    def workspace(self, num_seqs: int, max_context: int, num_heads: int, head_dim: int) -> None:
        """None: the kernel allocates its partials per call (shapes only, so a CUDA graph keeps them)."""
        return None

    def num_partitions(self, max_blocks: int, block_size: int) -> int:
        """Programs per (row, KV head) for a table of max_blocks blocks: a shape, not a context."""
        return max(1, -(-max_blocks * block_size // self.partition_keys))

    def _tile_keys(self, block_d: int) -> int:
        """Keys per inner step: halved for heads over 128, whose float32 K and V tiles would spill."""
        return self.block_keys if block_d <= 128 else max(16, self.block_keys // 2)

    def self_check(self, device: torch.device) -> bool:
        """A tiny launch on ``device`` (two partitions, GQA group 2) against torch; compiles the kernels."""
        gen = torch.Generator().manual_seed(0)
        pool = torch.randn(3, 1, 2, 16, 1, 16, generator=gen)
        q = torch.randn(2, 2, 16, generator=gen)
        tables = torch.tensor([[2, 1], [1, 0]])
        lens = torch.tensor([20, 5])
        small = TritonDecodeKernel(partition_keys=16, block_keys=16)
        got = small.attend(q.to(device), pool.to(device), 0, tables.to(device), lens.to(device)).cpu()
        want = []
        for i in range(2):
            k = pool[tables[i], 0, 0].reshape(-1, 1, 16)[:lens[i], 0]
            v = pool[tables[i], 0, 1].reshape(-1, 1, 16)[:lens[i], 0]
            want.append(torch.softmax(q[i] @ k.T / 4.0, -1) @ v)
        return torch.allclose(got, torch.stack(want).reshape(2, 32), atol=1e-4, rtol=1e-4)

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor, layer: int, dec: DecodeBatch) -> torch.Tensor:
        """Attention of q [N, heads, head_dim] (rows may be strided) -> [N, heads * head_dim]."""
        return self.attend(q, kv_cache, layer, dec.block_tables, dec.context_lens)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_tables: torch.Tensor,
               context_lens: torch.Tensor, scale: float | None = None, softcap: float | None = None,
               window: int | None = None, first_keys: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of q [N, heads, head_dim] over each row's table -> [N, heads * head_dim].

        Row i's query sits at position context_lens[i] - 1; its table's entry t holds position
        ``first_keys[i] + t`` (0 + t without first_keys). ``scale`` defaults to 1/sqrt(head_dim).
        """
        n, num_heads, head_dim = q.shape
        _, _, _, block_size, num_kv_heads, _ = kv_cache.shape
        group = num_heads // num_kv_heads
        if q.stride(2) != 1:
            q = q.contiguous()
        if kv_cache.stride(5) != 1:
            raise ValueError("the Triton decode kernel reads K/V rows with unit stride")
        out = torch.empty(n, num_heads * head_dim, dtype=q.dtype, device=q.device)
        if n == 0:
            return out
        tables = block_tables if block_tables.is_contiguous() else block_tables.contiguous()
        parts = self.num_partitions(tables.shape[1], block_size)
        block_d = max(16, triton.next_power_of_2(head_dim))
        scratch = [out] * 3                        # unused pointers when one partition writes `out`
        if parts > 1:
            scratch = [torch.empty(n * num_heads * parts, dtype=torch.float32, device=q.device),
                       torch.empty(n * num_heads * parts, dtype=torch.float32, device=q.device),
                       torch.empty(n * num_heads * parts * block_d, dtype=torch.float32, device=q.device)]
        s = kv_cache.stride()
        _decode_partition[(n, num_kv_heads, parts)](
            q, kv_cache, tables, context_lens, context_lens if first_keys is None else first_keys, out, *scratch,
            layer, tables.shape[1], block_size, head_dim, group,
            head_dim ** -0.5 if scale is None else scale, 1.0 if softcap is None else softcap,
            0 if window is None else window, q.stride(0), q.stride(1), *s[:5], num_heads, parts,
            HAS_FIRST=first_keys is not None, HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None,
            SINGLE=parts == 1, PART_KEYS=self.partition_keys, BLOCK_N=self._tile_keys(block_d),
            BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d,
            PRECISION="ieee" if kv_cache.dtype == torch.float32 else "tf32")
        if parts > 1:
            _merge_partitions[(n, num_heads)](out, *scratch, head_dim, num_heads, parts, BLOCK_P=16, BLOCK_D=block_d)
        return out

