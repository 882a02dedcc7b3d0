"""Attention over the paged KV pool: write the step's new K/V into their slots, attend over the context.

Pool layout (one tensor, shared by every layer)::

    kv_cache[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]   (2 = K, V)

A block is contiguous across all layers, so one block can be copied out (CPU, disk, Redis) as a
single slice. Token at position p of a sequence lives at ``kv_cache[block_table[p // B], :, :, p % B]``.

The runner orders a step's tokens as: decode rows first (one new token each, each seeing the keys
up to its own position; a short chunk over a cached prefix is one row per token), then prefill
chunks (one contiguous span each). Every layer reuses the one ``AttnMetadata`` built per step.
Decode reads K/V straight from the pool with a small C++ kernel on CPU
(``decode_kernel.CpuDecodeKernel``, built once per machine with the system compiler) and on CUDA with a
Triton kernel (``triton_decode.TritonDecodeKernel``); elsewhere, or without either, it gathers the
sequences' blocks and runs one padded SDPA. Prefill chunks attend causally to their whole context
(cached prefix + the chunk itself): on CPU with AVX2 or AVX-512 straight from the pool in a C++
flash kernel (``prefill_kernel.CpuPrefillKernel``), on CUDA in one Triton launch for all chunks
(``triton_prefill.TritonPrefillKernel``); elsewhere over their own K/V (first chunk) or the
gathered context, as batched GEMMs over query blocks (``prefill_attention``) where that beats
torch's flash SDPA, else with SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kvhive.model.pool_values import gathered_values, store_rows, stored_values
from kvhive.model.timing import min_times

if TYPE_CHECKING:
    from kvhive.model.decode_kernel import CpuDecodeKernel
    from kvhive.model.prefill_kernel import CpuPrefillKernel
    from kvhive.model.triton_prefill import TritonPrefillKernel
    from kvhive.model.window_kv import WindowKV


@dataclass(frozen=True)
class PrefillSpan:
    """One sequence's prefill chunk: tokens [begin, end) of the flat batch at positions start_pos..."""

    begin: int
    end: int
    start_pos: int
    # Pool blocks holding positions 0..context_len-1 (int64). None only when start_pos == 0 and no
    # prefill kernel runs: torch then attends over the chunk's own K/V; the pool is only written.
    block_ids: torch.Tensor | None
    # [num_new, context_len] bool, True where query i may see key j (j <= start_pos + i), for
    # torch's SDPA over a cached prefix; None when start_pos == 0 or the prefill kernel runs.
    mask: torch.Tensor | None

    @property
    def context_len(self) -> int:
        """Keys attended to: cached prefix + this chunk."""
        return self.start_pos + self.end - self.begin


@dataclass(frozen=True)
class DecodeBatch:
    """The step's decode rows: the first num_seqs tokens of the batch, each with its own context."""

    num_seqs: int
    block_tables: torch.Tensor          # [num_seqs, max_blocks] int64; padding points at block 0
    context_lens: torch.Tensor          # [num_seqs] int64, new token included
    mask: torch.Tensor | None           # [num_seqs, 1, 1, max_blocks * B] bool (SDPA path only)
    kernel: CpuDecodeKernel | None      # or a TritonDecodeKernel; None: gather the blocks and run SDPA
    workspace: torch.Tensor | None      # float32 chunk partials for the kernel (None: it needs none)


@dataclass(frozen=True)
class AttnMetadata:
    """Where each new token's K/V goes and what every query attends to; built once per step."""

    # [T, 2]: rows of the layer-0 view ``kv_cache.view(-1, kv_heads * head_dim)`` that receive each
    # token's K and V; layer l adds l * 2 * block_size (a block's layers are consecutive).
    slot_rows: torch.Tensor
    decode: DecodeBatch | None
    prefills: tuple[PrefillSpan, ...]
    # Prefill attention straight from the pool (the C++ kernel on CPU, Triton on CUDA); None: torch
    # over gathered K/V.
    prefill_kernel: CpuPrefillKernel | TritonPrefillKernel | None = None
    # KV connector worker: ``wait_for_layer_load(l)`` before layer l reads the pool, then
    # ``save_kv_layer(l)`` after it; None without a connector.
    layer_hooks: LayerHooks | None = None
    # The window layers' own pool and metadata (``kvhive.model.window_kv``); None: one pool for all.
    window: WindowKV | None = None
    # The rows whose final hidden state the step reads, where fewer than all; None: every row.
    out_rows: OutputRows | None = None
    # The rows the step would have without speculative drafts, where it has drafts: a model whose
    # matmul path depends on the row count (GGUF blocks up to ``quant_max_rows`` rows, a rounded
    # dense copy above) picks it by these, so a drafted step multiplies by the weights a plain one
    # would. None: the step's own rows.
    plain_rows: int | None = None


@dataclass(frozen=True)
class OutputRows:
    """The rows of a step whose last-layer output is read (the sampled ones, in batch order).

    The other rows still need the last layer's K/V, written to the pool for later steps, but not
    its attention, output projection or MLP, so a model computes those for these rows alone.
    """

    rows: torch.Tensor                  # [k] int64, ascending; may be empty
    # The last layer's attention over these rows' queries only (the pool written for every row);
    # None: attend for every row, then keep these.
    attn: AttnMetadata | None


def output_rows(meta: AttnMetadata, rows: list[int], device: torch.device) -> OutputRows:
    """``OutputRows`` for batch rows ``rows`` (ascending). The last layer's attention is restricted
    to them where the prefill kernel runs, no window pool is in use, and every kept row of a prefill
    span is its last (a span then becomes one query row at its last position)."""
    index = torch.tensor(rows, dtype=torch.long, device=device)
    attn = None
    if meta.prefill_kernel is not None and meta.window is None:
        attn = _restrict(meta, rows, index)
    return OutputRows(index, attn)


def _restrict(meta: AttnMetadata, rows: list[int], index: torch.Tensor) -> AttnMetadata | None:
    """``meta`` for the queries of ``rows`` alone (slot rows unchanged: every row's K/V is written)."""
    decode = meta.decode
    num_decode = decode.num_seqs if decode is not None else 0
    if decode is not None:
        dec_rows = [r for r in rows if r < num_decode]
        if not dec_rows:
            decode = None
        elif len(dec_rows) < num_decode:
            sel = index[:len(dec_rows)]
            decode = DecodeBatch(len(dec_rows), decode.block_tables.index_select(0, sel),
                                 decode.context_lens.index_select(0, sel),
                                 None if decode.mask is None else decode.mask.index_select(0, sel),
                                 decode.kernel, decode.workspace)
    spans = []
    offset = 0 if decode is None else decode.num_seqs
    for span in meta.prefills:
        inside = [r for r in rows if span.begin <= r < span.end]
        if not inside:
            continue
        if inside != [span.end - 1]:
            return None
        spans.append(PrefillSpan(offset, offset + 1, span.context_len - 1, span.block_ids, None))
        offset += 1
    return replace(meta, decode=decode, prefills=tuple(spans), out_rows=None)


class LayerHooks(Protocol):
    """The per-layer calls a KV connector's worker half gets during the forward pass."""

    def wait_for_layer_load(self, layer: int) -> None:
        """Block until this layer's loaded KV is in the pool."""
        ...

    def save_kv_layer(self, layer: int) -> None:
        """This layer's K/V for the step are written."""
        ...


def paged_attention(q: torch.Tensor, kv_new: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                    meta: AttnMetadata) -> torch.Tensor:
    """Store kv_new ([T, 2, kv_heads, head_dim]) for ``layer``, attend, return [T, heads * head_dim].

    q is [T, heads, head_dim] (rotary already applied; rows may be strided); query head h reads
    KV head h // group, as Hugging Face's repeat_kv does.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[4]
    # Write first: decode queries and cached-prefix prefills then read their own new K/V back.
    write_kv(kv_new, kv_cache, layer, meta)

    k_layer, v_layer = kv_cache[:, layer, 0], kv_cache[:, layer, 1]   # [blocks, B, kv_heads, hd]
    out_parts: list[torch.Tensor] = []
    dec = meta.decode
    if dec is not None and dec.kernel is not None:
        out_parts.append(dec.kernel(q[:dec.num_seqs], kv_cache, layer, dec))
    elif dec is not None:
        # One padded SDPA for all decode sequences; the group of query heads sharing a KV head is
        # folded into the query-length axis, so no KV expansion is needed.
        n = dec.num_seqs
        ids = dec.block_tables.view(-1)
        k = gathered_values(k_layer.index_select(0, ids), q.dtype).view(n, -1, num_kv_heads, head_dim)
        v = gathered_values(v_layer.index_select(0, ids), q.dtype).view(n, -1, num_kv_heads, head_dim)
        qd = q[:n].view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
        o = decode_sdpa(qd, k.transpose(1, 2), v.transpose(1, 2), dec.mask)
        out_parts.append(o.reshape(n, num_heads * head_dim))
    if meta.prefill_kernel is not None:
        # Every chunk straight from the pool (the Triton kernel: one launch for all of them).
        out_parts.extend(meta.prefill_kernel.attend_spans(q, kv_cache, layer, meta.prefills))
    else:
        if meta.prefills:
            kv_read = stored_values(kv_new, kv_cache)       # an 8-bit pool's values, as a later step reads them
            out_parts.extend(_gathered_prefill(q, kv_read, k_layer, v_layer, span) for span in meta.prefills)
    return out_parts[0] if len(out_parts) == 1 else torch.cat(out_parts)


def _gathered_prefill(q: torch.Tensor, kv_new: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor,
                      span: PrefillSpan) -> torch.Tensor:
    """One chunk's attention in torch: over its own K/V (no cached prefix) or its gathered context."""
    qs = q[span.begin:span.end]
    if span.block_ids is None:
        k, v = kv_new[span.begin:span.end, 0], kv_new[span.begin:span.end, 1]   # [n, kv_heads, hd]
    else:
        shape = (-1, k_layer.shape[2], q.shape[2])
        k = gathered_values(k_layer.index_select(0, span.block_ids), q.dtype).view(shape)[:span.context_len]
        v = gathered_values(v_layer.index_select(0, span.block_ids), q.dtype).view(shape)[:span.context_len]
    return prefill_attention(qs, k, v, span.mask)


def write_kv(kv_new: torch.Tensor, kv_cache: torch.Tensor, layer: int, meta: AttnMetadata) -> None:
    """Store the step's new K/V ([T, 2, kv_heads, head_dim]) of ``layer`` into their pool slots (an
    8-bit pool gets them quantized, ``kvhive.model.pool_values``)."""
    _, _, _, block_size, num_kv_heads, row = kv_cache.shape
    new = store_rows(kv_new, kv_cache)
    if new.element_size() == 1:             # 8-bit rows as bytes: index_put_ takes float8 nowhere
        new, kv_cache = new.view(torch.uint8), kv_cache.view(torch.uint8)
    rows = kv_cache.view(-1, num_kv_heads * row)[layer * 2 * block_size:]
    rows.index_put_((meta.slot_rows,), new.reshape(new.shape[0], 2, num_kv_heads * row))


def decode_mask(context_lens: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[rows, 1, 1, num_keys] bool: row i sees its first context_lens[i] keys (the SDPA decode path)."""
    keys = torch.arange(num_keys, device=context_lens.device)
    return (keys[None, :] < context_lens[:, None])[:, None, None, :]


def decode_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Decode attention over gathered K/V: q [n, kv_heads, group, hd], k and v [n, kv_heads, keys,
    hd], mask [n, 1, 1, keys] -> [n, kv_heads, group, hd].

    On CUDA in float32 it is two batched GEMMs and a softmax: SDPA's only float32 kernel with a mask
    (memory-efficient attention) tiles 64 queries, so with a group of 3 it ran ~190 us a layer on
    an H100, most of a decode step.
    """
    if q.device.type != "cuda" or q.dtype != torch.float32:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return _decode_matmuls(q, k, v, mask)


def _decode_matmuls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """decode_sdpa as two batched GEMMs and a softmax (any device; tests check it on CPU)."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(q.shape[-1] ** -0.5)
    return torch.matmul(scores.masked_fill_(~mask, float("-inf")).softmax(-1), v)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of the chunk's queries q [n, heads, hd] over k, v [ctx, kv_heads, hd] -> [n, heads * hd].

    The queries sit at the last n positions of the ctx keys (ctx - n of them are a cached prefix);
    mask ([n, ctx] bool, True where query i sees key j) may be given then, else it is built when
    needed. Rows of q, k and v may be strided.
    """
    n, num_heads, head_dim = q.shape
    min_new, max_new = PREFILL_BLOCKED_NEW_TOKENS
    if (q.device.type == "cpu" and q.dtype == torch.float32 and min_new <= n <= max_new
            and k.shape[0] <= PREFILL_BLOCKED_MAX_KEYS):
        o = _blocked_prefill(q, k, v)
    else:
        o = _sdpa_prefill(q, k, v, mask)
    return o.reshape(n, num_heads * head_dim)


# Where the blocked GEMMs beat torch's flash SDPA on CPU in float32 (SmolLM2-135M: 9 heads / 3 KV
# heads of 64, 1 and 2 threads; in bf16 SDPA wins: 0.85 against 2.0 ms for 512 new tokens on an
# Intel Xeon with AMX): chunks of this many new tokens over at most this many keys. Outside, SDPA is
# as fast or faster, and less hurt when other processes take the cores (one parallel region
# instead of four per query block).
PREFILL_BLOCKED_NEW_TOKENS = (128, 1024)
PREFILL_BLOCKED_MAX_KEYS = 2048
# Query rows per block of the blocked prefill: its scores, [kv_heads, block * group, ctx] float32,
# should stay within the last-level cache.
PREFILL_QUERY_BLOCK = 64


def _sdpa_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """prefill_attention by torch's SDPA: [n, heads, hd]."""
    n, ctx = q.shape[0], k.shape[0]
    if q.device.type == "cuda":
        return _fused_sdpa_prefill(q, k, v)
    # SDPA gets 4-D [1, heads, len, hd] views: 3-D inputs fall back to the slow math kernel on CPU.
    qs, ks, vs = (t[None].transpose(1, 2) for t in (q, k, v))
    if ctx == n:
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
    else:
        if mask is None:
            mask = torch.ones(n, ctx, dtype=torch.bool, device=q.device).tril_(ctx - n)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
    return o[0].transpose(0, 1)


def _fused_sdpa_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """prefill_attention as CUDA runs it: [n, heads, hd], by the fused SDPA kernels (flash for 16-bit
    types, memory-efficient for float32). It runs on CPU too (tests check it there).

    Two things would send SDPA to its unfused math kernel, which writes the whole [heads, n, ctx]
    score matrix (3.5x slower for 2,048 new tokens on 3,456 cached, H100, float32): ``enable_gqa``
    and a dense boolean mask. So KV heads are repeated to the query heads, and a chunk over a cached
    prefix gets the lower-right causal bias (query i sees keys up to ctx - n + i), which the fused
    kernels apply without a mask tensor.
    """
    n, ctx = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    qs, ks, vs = (t[None].transpose(1, 2) for t in (q, k, v))
    if ctx == n:
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
    else:
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=causal_lower_right(n, ctx))
    return o[0].transpose(0, 1)


def _blocked_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """prefill_attention by batched GEMMs over query blocks, in float32: [n, heads, hd].

    The group of query heads sharing a KV head is folded into the query axis (rows ordered
    (token, head in group)), so each block is one batched GEMM of [kv_heads, block * group, keys]
    that reads each KV head once. A block scores only the keys up to its own last position; of
    those, only the block's own tokens (the diagonal square) need the causal mask.
    """
    n, num_heads, head_dim = q.shape
    ctx, num_kv_heads, _ = k.shape
    group, prefix = num_heads // num_kv_heads, ctx - n
    # MKL shares a batched GEMM out by whole batch items: with an odd number of KV heads and an even
    # number of threads, each block is cut into `split` parts along the queries, one item per
    # (part, KV head), and K/V are stored once per part.
    split = 2 if num_kv_heads % 2 and torch.get_num_threads() % 2 == 0 else 1
    part = -(-min(PREFILL_QUERY_BLOCK, n) // split)            # tokens per part; block = split parts
    block, items, rows = part * split, split * num_kv_heads, part * group
    padded = -(-n // block) * block                            # pad rows compute garbage, then dropped
    f32 = torch.float32
    # qp[c, h, (t, g)] = q[c * part + t, h * group + g]
    qp = torch.zeros(padded, num_kv_heads, group, head_dim, dtype=f32)
    qp[:n] = q.view(n, num_kv_heads, group, head_dim)
    qp = qp.view(padded // part, part, num_kv_heads, rows // part, head_dim).transpose(1, 2).reshape(
        padded // part, num_kv_heads, rows, head_dim)
    kp = torch.empty(split, num_kv_heads, ctx, head_dim, dtype=f32)
    vp = torch.empty(split, num_kv_heads, ctx, head_dim, dtype=f32)
    kp.copy_(k.transpose(0, 1)[None])
    vp.copy_(v.transpose(0, 1)[None])
    kt, vs = kp.view(items, ctx, head_dim).transpose(1, 2), vp.view(items, ctx, head_dim)
    # Added to a block's own keys: row (token i, head g) of part s may not see key j when j > s * part + i.
    hidden = torch.ones(block, block, dtype=torch.bool).triu_(1).view(split, part, block)
    causal_bias = torch.zeros(split, part, group, block, dtype=f32).masked_fill_(
        hidden[:, :, None], float("-inf")).view(split, 1, rows, block)
    scores = torch.empty(items * rows * ctx, dtype=f32)
    out = torch.empty(padded // part, num_kv_heads, rows, head_dim, dtype=f32)
    for a in range(0, n, block):
        own = min(block, n - a)                                # real tokens of the block
        keys = prefix + a + own
        s = scores[:items * rows * keys].view(items, rows, keys)
        qb = qp[a // part:a // part + split].view(items, rows, head_dim)
        torch.baddbmm(s, qb, kt[:, :, :keys], beta=0.0, alpha=head_dim ** -0.5, out=s)
        s.view(split, num_kv_heads, rows, keys)[..., prefix + a:].add_(causal_bias[..., :own])
        torch._softmax(s, -1, False, out=s)            # in place (aten's out= form); float32
        torch.bmm(s, vs[:, :keys], out=out[a // part:a // part + split].view(items, rows, head_dim))
    o = out.view(padded // part, num_kv_heads, part, group, head_dim).transpose(1, 2)
    return o.reshape(padded, num_heads, head_dim)[:n].to(q.dtype)


def torch_prefill_is_faster(kernel: CpuPrefillKernel, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                            head_dim: int, margin: float = 0.9) -> bool:
    """True where torch's prefill attention on gathered K/V runs a synthetic layer in under ``margin``
    of the C++ kernel's time (a cold 1,024-token chunk plus 96 new tokens on 1,024 cached,
    alternating, min of 3 each; ~0.1 s). On an Intel Xeon with AMX, torch's bf16 flash attention
    runs on AMX tiles: 5.0 against 9.7 ms for 1,600 new tokens, 1.0 against 1.5 ms for 96 on 1,760."""
    block, gen = 16, torch.Generator().manual_seed(0)
    pool = torch.randn(72, 1, 2, block, num_kv_heads, head_dim, generator=gen).to(dtype)
    table = torch.randperm(72, generator=gen)           # 72 blocks of 16 hold 1,120 tokens
    shapes = [(0, 1024), (1024, 96)]                 # (cached, new)
    qs = [torch.randn(n, num_heads, head_dim, generator=gen).to(dtype) for _, n in shapes]

    def run_kernel() -> None:
        for (start, n), q in zip(shapes, qs, strict=True):
            kernel(q, pool, 0, table[:-(-(start + n) // block)].contiguous(), start)

    def run_torch() -> None:
        for (start, n), q in zip(shapes, qs, strict=True):
            ids = table[:-(-(start + n) // block)]
            k = pool[:, 0, 0].index_select(0, ids).view(-1, num_kv_heads, head_dim)[:start + n]
            v = pool[:, 0, 1].index_select(0, ids).view(-1, num_kv_heads, head_dim)[:start + n]
            prefill_attention(q, k, v)

    kernel_s, torch_s = min_times([run_kernel, run_torch], 3)
    return torch_s < margin * kernel_s
