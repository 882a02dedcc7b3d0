"""Masked attention over the paged KV pool for layers the shared paths cannot run exactly.

``paged_attention``'s paths (the C++ decode and prefill kernels, torch SDPA, the blocked GEMMs)
attend causally to the whole context with 1/sqrt(head_dim) scores. A layer that attends to a
sliding window of keys, or soft-caps its scores (``cap * tanh(score / cap)``, Gemma 2), runs here
instead: the layer's new K/V are written to the pool the same way, then each decode row and each
prefill chunk gathers its keys from the pool (a chunk with no cached prefix uses its own K/V) and
computes the scores in the model dtype, caps them, masks every key outside
``(position - window, position]``, and takes the softmax in float32, in transformers' eager order.
Where the step's prefill kernel takes these rules (the Triton kernel on CUDA), the prefill chunks
run through it instead, straight from the pool with float32 scores.

A prefill chunk of a window layer gathers only the blocks its window reaches. Decode rows gather
their block table and mask; with the window layers' own pool (``kvhive.model.window_kv``) their
tables start at the first block their window reaches (``decode_first_keys``), so a window layer
reads about ``window`` keys per row however long the context (``docs/sliding_window.md``).

Where the step's decode kernel applies a rule itself (``ScoredDecodeKernel``: the Triton paged kernel
on CUDA), decode rows skip the gather and run through it with the rule's scale, soft-cap and window
(scores in float32 there, rather than in the model dtype).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from kvhive.model.attention import AttnMetadata, DecodeBatch, PrefillSpan, write_kv
from kvhive.model.pool_values import gathered_values, stored_values


@dataclass(frozen=True)
class ScoreRule:
    """How one layer scores keys: the scale, the soft-cap (None: none), the window (None: all keys)."""

    scale: float
    softcap: float | None = None
    window: int | None = None


@runtime_checkable
class ScoredDecodeKernel(Protocol):
    """A decode kernel that reads the pool through the block tables under a score rule itself."""

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_tables: torch.Tensor,
               context_lens: torch.Tensor, scale: float | None = None, softcap: float | None = None,
               window: int | None = None, first_keys: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of q [N, heads, head_dim] -> [N, heads * head_dim]; changes nothing."""
        ...


def masked_paged_attention(q: torch.Tensor, kv_new: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                           meta: AttnMetadata, rule: ScoreRule,
                           decode_first_keys: torch.Tensor | None = None) -> torch.Tensor:
    """``paged_attention`` under ``rule``: store kv_new for ``layer``, attend, return [T, heads * head_dim].

    ``decode_first_keys`` ([decode rows]): the position of each decode row's first table entry
    (its table starts at the first block its window reaches); None: every table starts at 0."""
    write_kv(kv_new, kv_cache, layer, meta)
    k_layer, v_layer = kv_cache[:, layer, 0], kv_cache[:, layer, 1]   # [blocks, B, kv_heads, hd]
    parts: list[torch.Tensor] = []
    dec = meta.decode
    if dec is not None and isinstance(dec.kernel, ScoredDecodeKernel):
        parts.append(dec.kernel.attend(q[:dec.num_seqs], kv_cache, layer, dec.block_tables, dec.context_lens,
                                       rule.scale, rule.softcap, rule.window, decode_first_keys))
    elif dec is not None:
        parts.append(_decode_rows(q, k_layer, v_layer, dec, rule, decode_first_keys))
    kernel = meta.prefill_kernel
    if meta.prefills and kernel is not None and kernel.takes_score_rules:
        # Straight from the pool, every chunk in one launch, scores in float32 (the Triton kernel).
        parts.extend(kernel.attend_spans(q, kv_cache, layer, meta.prefills, rule))
    else:
        kv_read = stored_values(kv_new, kv_cache) if meta.prefills else kv_new   # an 8-bit pool's values
        parts.extend(_prefill_span(q, kv_read, k_layer, v_layer, span, rule) for span in meta.prefills)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def visible(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[queries, keys] bool: key j is visible to the query at position p when j <= p (and p - j < window).
    ``key_pos``: [keys] shared by every query, or [queries, keys], each query's own."""
    keys, queries = (key_pos if key_pos.dim() == 2 else key_pos[None, :]), query_pos[:, None]
    seen = keys <= queries
    if window is not None:
        seen &= keys > queries - window
    return seen


def _decode_rows(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, dec: DecodeBatch,
                 rule: ScoreRule, first_keys: torch.Tensor | None) -> torch.Tensor:
    """The decode rows' attention: each row over its own block table, up to its own position."""
    n, block_size = dec.num_seqs, k_layer.shape[1]
    ids = dec.block_tables.view(-1)
    k = gathered_values(k_layer.index_select(0, ids), q.dtype).view(n, -1, k_layer.shape[2], q.shape[2])
    v = gathered_values(v_layer.index_select(0, ids), q.dtype).view(n, -1, v_layer.shape[2], q.shape[2])
    keys = torch.arange(dec.block_tables.shape[1] * block_size, device=q.device)
    if first_keys is not None:                                      # row i's keys start at first_keys[i]
        keys = first_keys[:, None] + keys[None, :]
    mask = visible(dec.context_lens - 1, keys, rule.window)        # row i is at position context_lens[i] - 1
    return attend(q[:n, None], k, v, mask[:, None], rule).reshape(n, -1)


def _prefill_span(q: torch.Tensor, kv_new: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor,
                  span: PrefillSpan, rule: ScoreRule) -> torch.Tensor:
    """One prefill chunk's attention over its context (from the first block its window reaches)."""
    block_size = k_layer.shape[1]
    qs, n = q[span.begin:span.end], span.end - span.begin
    first_key = 0
    if span.block_ids is None:                     # no cached prefix: the chunk's own K/V
        k, v = kv_new[span.begin:span.end, 0], kv_new[span.begin:span.end, 1]
    else:
        first_block = 0 if rule.window is None else max(0, span.start_pos - rule.window + 1) // block_size
        first_key, ids = first_block * block_size, span.block_ids[first_block:]
        k = gathered_values(k_layer.index_select(0, ids), q.dtype).flatten(0, 1)[:span.context_len - first_key]
        v = gathered_values(v_layer.index_select(0, ids), q.dtype).flatten(0, 1)[:span.context_len - first_key]
    query_pos = torch.arange(span.start_pos, span.start_pos + n, device=q.device)
    key_pos = torch.arange(first_key, span.context_len, device=q.device)
    mask = visible(query_pos, key_pos, rule.window)
    return attend(qs[None], k[None], v[None], mask[None], rule)[0].reshape(n, -1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, rule: ScoreRule) -> torch.Tensor:
    """q [b, t, heads, hd] over k, v [b, s, kv_heads, hd] where mask [b, t, s] -> [b, t, heads, hd].

    As transformers' eager attention: scores in the model dtype times the scale, soft-capped,
    masked, softmax in float32 cast back, times V; query head h reads KV head h // group.
    """
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2).transpose(1, 2), v.repeat_interleave(group, dim=2).transpose(1, 2)
    scores = torch.matmul(q.transpose(1, 2), k.transpose(-1, -2)) * rule.scale   # [b, heads, t, s]
    if rule.softcap is not None:
        scores = torch.tanh(scores / rule.softcap) * rule.softcap
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v).transpose(1, 2)
