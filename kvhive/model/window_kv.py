"""The window layers' own KV pool as the runner and the model see it.

With a window pool (``kvhive.kv.window_group``) the runner keeps two tensors: the main pool with
the global layers only and ``WindowKV.cache`` with the window layers only, each in the layout of
``kvhive.model.attention`` (its own layer count). Each scheduled sequence carries a window table
beside its block table; ``window_kv`` turns a step's main ``AttnMetadata`` into the window
layers' one: their slot rows, the decode rows' window tables, the prefill chunks' window block
ids. Released entries are block 0 of the window pool, which no row reads unmasked (they lie
before every row's window). The decode rows keep the step's decode kernel only where it applies
the window itself (``ScoredDecodeKernel``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvhive.model.attention import AttnMetadata
from kvhive.model.window_attention import ScoredDecodeKernel

if TYPE_CHECKING:
    from kvhive.engine.step import ScheduledSeq


@dataclass(frozen=True)
class WindowKV:
    """The window layers' pool and where this step's window layers write and read in it."""

    cache: torch.Tensor        # [window blocks, window layers, 2, block_size, kv_heads, head_dim]
    meta: AttnMetadata         # slot rows, decode tables and prefill block ids in window-pool blocks
    # [decode rows] int64: the position of each decode row's first key (its table starts at the
    # first block its window reaches); None without decode rows.
    decode_first_keys: torch.Tensor | None = None


def group_indices(window_layers: tuple[bool, ...]) -> list[int]:
    """Per layer, its index among the layers of its own group (window or global)."""
    seen = {True: 0, False: 0}
    out = []
    for flag in window_layers:
        out.append(seen[flag])
        seen[flag] += 1
    return out


def window_kv(meta: AttnMetadata, decodes: list[ScheduledSeq], prefills: list[ScheduledSeq],
              cache: torch.Tensor, window: int) -> WindowKV:
    """The window layers' view of a step whose seqs run as ``decodes`` rows then ``prefills`` spans
    (``window``: the keys a window layer sees)."""
    block_size, rows_per_block = cache.shape[3], cache.shape[1] * 2 * cache.shape[3]
    rows: list[np.ndarray] = []
    for s in decodes + prefills:
        table = np.asarray(_table(s), dtype=np.int64)
        pos = np.arange(s.start_pos, s.context_len)
        rows.append(table[pos // block_size] * rows_per_block + pos % block_size)
    base = torch.from_numpy(np.concatenate(rows)).to(cache.device)
    slot_rows = torch.stack([base, base + block_size], dim=1)
    decode, first_keys = meta.decode, None
    if decode is not None:
        tables, first_keys = _decode_tables(decodes, block_size, window)
        kernel = decode.kernel if isinstance(decode.kernel, ScoredDecodeKernel) else None
        decode = dataclasses.replace(decode, block_tables=tables.to(cache.device), mask=None, kernel=kernel,
                                     workspace=None)
        first_keys = first_keys.to(cache.device)
    spans = tuple(dataclasses.replace(span, mask=None, block_ids=None if span.block_ids is None else torch.tensor(
        _table(s)[:span.block_ids.shape[0]], dtype=torch.int64, device=cache.device))
        for span, s in zip(meta.prefills, prefills, strict=True))
    # A prefill kernel that applies the window itself reads the window pool in place; others do not.
    kernel = meta.prefill_kernel if meta.prefill_kernel is not None and meta.prefill_kernel.takes_score_rules else None
    return WindowKV(cache, AttnMetadata(slot_rows=slot_rows, decode=decode, prefills=spans, prefill_kernel=kernel),
                    first_keys)


def _decode_tables(decodes: list[ScheduledSeq], block_size: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per decode row: its window table from the first block it can see (padding: block 0), and
    that block's first position. Rows see keys position - window + 1 .. position."""
    spans = []
    for s in decodes:
        table = _table(s)
        for length in range(s.start_pos + 1, s.context_len + 1):
            first = max(0, length - window) // block_size
            spans.append((first, table[first:-(-length // block_size)]))
    tables = np.zeros((len(spans), max(len(ids) for _, ids in spans)), dtype=np.int64)
    for j, (_, ids) in enumerate(spans):
        tables[j, :len(ids)] = ids
    first_keys = np.array([first * block_size for first, _ in spans], dtype=np.int64)
    return torch.from_numpy(tables), torch.from_numpy(first_keys)


def _table(seq: ScheduledSeq) -> list[int]:
    """The seq's window table; ValueError when the plan has none (the pool needs one per seq)."""
    if seq.window_table is None:
        raise ValueError(f"request {seq.request_id}: no window table for the window pool")
    return seq.window_table
