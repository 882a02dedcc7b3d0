"""A store object's bytes over the engine's KV pool, or its main and window pools.

A store object is one block of every layer in layer order, ``[num_layers, 2, block_size,
kv_heads, head_dim]`` (the one-pool layout, ``KV_LAYOUT_VERSION``). With a window pool
(``kvhive.kv.window_group``) a block's global layers live in the main pool and its window layers
in the window pool under the sequence's window table; ``PoolBlocks`` gathers the two parts into
that layout and scatters it back, so the bytes are exactly those a one-pool engine moves and the
tiers stay shared between both kinds of engine.

A window entry of 0 (the window pool's null block) means "no window part": a load skips the
window layers of that block (no row after the load sees them); a save never has one.

An 8-bit pool (``kvhive.model.kv_quant``: int8 or float8 rows with their scales) is handled as
the bytes it is, through a uint8 view: its blocks move unchanged, and torch copies bytes on
every device (it has no ``index_copy_`` for float8 on CPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from kvhive.kv.pool import NULL_BLOCK_ID
from kvhive.model.window_kv import group_indices


class LoadTargets(NamedTuple):
    """A batch of loaded blocks' destinations, on the pool's device."""

    block_ids: torch.Tensor                 # main block of each loaded block
    window_ids: torch.Tensor | None         # the window blocks wanted (None: one pool)
    window_rows: torch.Tensor | None        # which loaded blocks those are (same length)


class PoolBlocks:
    """Whole blocks of every layer, read from and written to the KV pool (or pools)."""

    def __init__(self, kv: torch.Tensor) -> None:
        """``kv``: the main pool ``[num_blocks, layers, 2, block_size, kv_heads, head_dim]``."""
        if not kv[0].is_contiguous():
            raise ValueError("the KV pool must keep each block contiguous")
        self.kv = _bytes_if_8bit(kv)
        self.window: torch.Tensor | None = None
        # Per layer: whether it lives in the window pool, and its index in its pool.
        self._layers: list[tuple[bool, int]] = [(False, i) for i in range(kv.shape[1])]
        self._split: tuple[np.ndarray, np.ndarray] | None = None     # global, window layer numbers
        self._split_index: tuple[torch.Tensor, torch.Tensor] | None = None   # the same, on the pool's device

    def add_window_pool(self, window: torch.Tensor, window_layers: tuple[bool, ...]) -> None:
        """Keep ``window_layers`` (per layer: True where it lives in ``window``) out of the main pool."""
        window = _bytes_if_8bit(window)
        if not window[0].is_contiguous() or window.dtype != self.kv.dtype or window.shape[2:] != self.kv.shape[2:]:
            raise ValueError("the window pool must keep the main pool's block layout and dtype")
        if sum(window_layers) != window.shape[1] or len(window_layers) - window.shape[1] != self.kv.shape[1]:
            raise ValueError(f"{len(window_layers)} layers do not split into the pools' "
                             f"{self.kv.shape[1]} and {window.shape[1]}")
        self.window = window
        self._layers = list(zip(window_layers, group_indices(window_layers), strict=True))
        flags = np.array(window_layers, dtype=bool)
        self._split = (np.flatnonzero(~flags), np.flatnonzero(flags))
        self._split_index = tuple(torch.from_numpy(part).to(self.kv.device) for part in self._split)

    @property
    def num_layers(self) -> int:
        """Layers in a store object."""
        return len(self._layers)

    @property
    def block_bytes(self) -> int:
        """Bytes of one store object's payload (one block of every layer)."""
        return self.kv[0].nbytes + (0 if self.window is None else self.window[0].nbytes)

    def gather(self, block_ids: Sequence[int], window_ids: Sequence[int]) -> torch.Tensor:
        """Blocks ``block_ids`` (window parts in ``window_ids``; unused with one pool) in the
        store layout, ``[n, num_layers, 2, block_size, kv_heads, head_dim]``, on the pool's device."""
        device = self.kv.device
        main = self.kv.index_select(0, torch.tensor(block_ids, device=device))
        if self.window is None:
            return main
        if len(window_ids) != len(block_ids) or NULL_BLOCK_ID in window_ids:
            raise ValueError("every saved block needs its window part")
        out = torch.empty((len(block_ids), self.num_layers, *self.kv.shape[2:]), dtype=self.kv.dtype, device=device)
        global_layers, window_layers = self._split_index
        out[:, global_layers] = main
        out[:, window_layers] = self.window.index_select(0, torch.tensor(window_ids, device=device))
        return out

    def load_targets(self, block_ids: Sequence[int], window_ids: Sequence[int] | None) -> LoadTargets:
        """Where a batch of loaded blocks goes: main blocks, and the window blocks that are wanted."""
        device = self.kv.device
        ids = torch.tensor(block_ids, dtype=torch.int64, device=device)
        if self.window is None:
            return LoadTargets(ids, None, None)
        if window_ids is None or len(window_ids) != len(block_ids):
            raise ValueError("a load into a window pool needs each block's window entry")
        rows = [i for i, w in enumerate(window_ids) if w != NULL_BLOCK_ID]
        return LoadTargets(ids, torch.tensor([window_ids[i] for i in rows], dtype=torch.int64, device=device),
                           torch.tensor(rows, dtype=torch.int64, device=device))

    def copy_layer(self, layer: int, src: torch.Tensor, targets: LoadTargets) -> None:
        """Copy layer ``layer`` of loaded blocks ``src`` (``[n, 2, block_size, kv_heads, head_dim]``,
        on the pool's device) into their blocks (window layers: only the wanted window blocks)."""
        in_window, index = self._layers[layer]
        if not in_window:
            self.kv[:, index].index_copy_(0, targets.block_ids, src)
        elif targets.window_rows.numel():
            self.window[:, index].index_copy_(0, targets.window_ids, src.index_select(0, targets.window_rows))

    def write_block(self, block_id: int, window_id: int, payload: Any) -> None:
        """Copy one store payload into main block ``block_id`` and, with a window pool and a
        ``window_id`` other than 0, its window layers into window block ``window_id``."""
        src = np.frombuffer(payload, dtype=np.uint8)
        if self.window is None:
            _write(self.kv[block_id], src)
            return
        rows = src.reshape(self.num_layers, -1)
        global_layers, window_layers = self._split
        _write(self.kv[block_id], rows[global_layers])
        if window_id != NULL_BLOCK_ID:
            _write(self.window[window_id], rows[window_layers])


def _bytes_if_8bit(pool: torch.Tensor) -> torch.Tensor:
    """A pool of one-byte elements (int8, float8) as uint8, the same memory; others as they are."""
    return pool.view(torch.uint8) if pool.element_size() == 1 else pool


def _write(block: torch.Tensor, src: np.ndarray) -> None:
    """Copy bytes ``src`` into the contiguous pool block ``block``."""
    dst = block.view(-1).view(torch.uint8)
    if dst.is_cuda:
        flat = np.ascontiguousarray(src).reshape(-1)
        with torch.inference_mode():      # a payload's own buffer is read-only: torch needs a writable one
            dst.copy_(torch.from_numpy(flat if flat.flags.writeable else flat.copy()))
    else:
        dst.numpy()[:] = src.reshape(-1)
