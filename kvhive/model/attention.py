"""Attention over the paged KV pool: write the step's new K/V into their slots, attend over the context.

Pool layout (one tensor, shared by every layer)::

    kv_cache[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]   (2 = K, V)

A block is contiguous across all layers, so one block can be copied out (CPU, disk, Redis) as a
single slice. Token at position p of a sequence lives at ``kv_cache[block_table[p // B], :, :, p % B]``.

The runner orders a step's tokens as: decode sequences first (exactly one new token each), then
prefill chunks (one contiguous span each). Every layer reuses the one ``AttnMetadata`` built per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PrefillSpan:
    """One sequence's prefill chunk: tokens [begin, end) of the flat batch at positions start_pos..."""

    begin: int
    end: int
    start_pos: int
    # Pool blocks holding positions 0..context_len-1; None when start_pos == 0 (nothing cached:
    # attention uses the chunk's own K/V and a causal mask, the pool is only written).
    block_ids: torch.Tensor | None
    # [num_new, context_len] bool, True where query i may see key j (j <= start_pos + i); None
    # when start_pos == 0 (plain causal attention).
    mask: torch.Tensor | None

    @property
    def context_len(self) -> int:
        """Keys attended to: cached prefix + this chunk."""
        return self.start_pos + self.end - self.begin


@dataclass(frozen=True)
class AttnMetadata:
    """Where each new token's K/V goes and what every query attends to; built once per step."""

    # [T, 2]: rows of the layer-0 view ``kv_cache.view(-1, kv_heads * head_dim)`` that receive each
    # token's K and V; layer l adds l * 2 * block_size (a block's layers are consecutive).
    slot_rows: torch.Tensor
    # The first num_decode tokens belong to decode sequences, one token each.
    num_decode: int
    # [num_decode * max_blocks]: each decode sequence's block table, padded to max_blocks blocks.
    decode_block_ids: torch.Tensor | None
    # [num_decode, 1, 1, max_blocks * block_size] bool: True on real context positions.
    decode_mask: torch.Tensor | None
    prefills: tuple[PrefillSpan, ...]


def paged_attention(q: torch.Tensor, kv_new: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                    meta: AttnMetadata) -> torch.Tensor:
    """Store kv_new ([T, 2, kv_heads, head_dim]) for ``layer``, attend, return [T, heads * head_dim].

    q is [T, heads, head_dim] (rotary already applied); query head h reads KV head h // group.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    # Write first: decode queries and cached-prefix prefills then read their own new K/V back.
    rows = kv_cache.view(-1, num_kv_heads * head_dim)[layer * 2 * block_size:]
    rows.index_put_((meta.slot_rows,), kv_new.reshape(num_tokens, 2, num_kv_heads * head_dim))

    k_layer, v_layer = kv_cache[:, layer, 0], kv_cache[:, layer, 1]   # [blocks, B, kv_heads, hd]
    out_parts: list[torch.Tensor] = []
    n_dec = meta.num_decode
    if n_dec:
        # One padded SDPA for all decode sequences; the group of query heads sharing a KV head is
        # folded into the query-length axis, so no KV expansion is needed.
        k = k_layer.index_select(0, meta.decode_block_ids).view(n_dec, -1, num_kv_heads, head_dim)
        v = v_layer.index_select(0, meta.decode_block_ids).view(n_dec, -1, num_kv_heads, head_dim)
        qd = q[:n_dec].view(n_dec, num_kv_heads, group, head_dim)
        o = F.scaled_dot_product_attention(qd, k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=meta.decode_mask)
        out_parts.append(o.reshape(n_dec, num_heads * head_dim))
    for span in meta.prefills:
        qs = q[span.begin:span.end].transpose(0, 1)                   # [heads, n, hd]
        if span.block_ids is None:
            kv = kv_new[span.begin:span.end]
            k, v = kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1)   # [kv_heads, n, hd]
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, enable_gqa=True)
        else:
            ctx = span.context_len
            k = k_layer.index_select(0, span.block_ids).view(-1, num_kv_heads, head_dim)[:ctx]
            v = v_layer.index_select(0, span.block_ids).view(-1, num_kv_heads, head_dim)[:ctx]
            o = F.scaled_dot_product_attention(qs, k.transpose(0, 1), v.transpose(0, 1),
                                               attn_mask=span.mask, enable_gqa=True)
        out_parts.append(o.transpose(0, 1).reshape(span.end - span.begin, num_heads * head_dim))
    return out_parts[0] if len(out_parts) == 1 else torch.cat(out_parts)
