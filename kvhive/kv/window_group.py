"""The window layers' KV: a pool of its own, a block table per sequence, freed as the window slides.

A model whose layers attend to a sliding window (Gemma 2 and 3) keeps two layer groups. The
global layers' K/V stay in the main pool under the manager's block tables; the window layers'
K/V go to a smaller pool of their own (``WindowGroup.pool``, a ``BlockPool``) under a second
table per sequence, entry i beside main block i. Once every position of block i is at least
``window`` positions behind the next position to compute, no row still to come can see it: the
entry is released to the window pool and points at the null block (block 0, never read unmasked).

Prefix caching: a full window block is cached in the window pool under the same chained hash as
its main block, so "the window part of block h is present" is ``h in pool.cached``. A released
block that was cached stays reusable (least recently released evicted first) until its slot is
needed. A prefix hit of j blocks is usable only when the window parts of the blocks a row at
position j * block_size can see are present; otherwise the hit is shortened to the longest
usable point (``usable_hit``), as vLLM's hybrid coordinator and SGLang's SWA tombstones do.

Torch-free; the manager (``kvhive.kv.manager``) calls it at each of its own steps. An owner is a
request id or ``("session", id)`` for a parked session.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace

from kvhive.config import EngineConfig, ModelConfig
from kvhive.kv.pool import NULL_BLOCK_ID, BlockPool, BlockPoolStats, KVBlock


@dataclass(frozen=True)
class WindowLayout:
    """Which layers attend to a window, the window's length and the window pool's size."""

    window_layers: tuple[bool, ...]   # per layer: True where its K/V live in the window pool
    window: int                       # keys a window layer sees, its own included
    num_blocks: int                   # window pool blocks, block 0 (the null block) included

    @property
    def num_window_layers(self) -> int:
        """Layers whose K/V live in the window pool."""
        return sum(self.window_layers)

    def describe(self, num_main_blocks: int) -> str:
        """One line for the startup log and /version: the two pools' sizes."""
        w, total = self.num_window_layers, len(self.window_layers)
        return (f"{w} of {total} layers in a window pool of {self.num_blocks - 1} blocks "
                f"(window {self.window}); {total - w} layers in {num_main_blocks - 1} blocks")


def window_layout(window_layers: Sequence[bool], window: int | None, block_size: int, num_blocks: int,
                  max_num_seqs: int, max_num_batched_tokens: int) -> WindowLayout | None:
    """The layout for a model's window layers; None when it has none, or no global layer to keep.

    The window pool holds what the running sequences can see plus each step's new blocks
    (``max_num_seqs`` windows and the step's token budget), twice over so that released blocks
    stay reusable for prefix hits a while; never more blocks than the main pool.
    """
    flags = tuple(bool(f) for f in window_layers)
    if window is None or not any(flags) or all(flags):
        return None
    per_seq = -(-window // block_size) + 2
    need = max_num_seqs * per_seq + -(-max_num_batched_tokens // block_size) + 1
    return WindowLayout(flags, window, max(2, min(num_blocks, 2 * need)))


def window_layout_for(model: ModelConfig, config: EngineConfig, one_pool: bool) -> WindowLayout | None:
    """The engine's window layout for ``model``; None for a model without window layers, or when
    ``one_pool`` (a disaggregating connector, which sends whole pool blocks of every layer)."""
    spec = model.gemma
    if spec is None or one_pool:
        return None
    sched = config.scheduler
    return window_layout(spec.window_layers, spec.sliding_window, config.cache.block_size, config.cache.num_blocks,
                         sched.max_num_seqs, sched.max_num_batched_tokens)


def fit_kv_budget(config: EngineConfig, model: ModelConfig, one_pool: bool) -> EngineConfig:
    """``config`` with ``cache.num_blocks`` set so that the main pool (global layers only) and the
    window pool together fill ``kv_cache_gb``: the bytes the window layers do not keep become
    more main blocks. Unchanged for a model without window layers, ``one_pool``, or an explicit
    ``num_blocks``."""
    if config.cache.num_blocks is not None or one_pool or model.gemma is None:
        return config
    full = config.kv_bytes_per_block(model)
    budget_blocks = config.cache.resolve_num_blocks(full)
    layout = window_layout_for(model, replace(config, cache=replace(config.cache, num_blocks=budget_blocks)), False)
    if layout is None:
        return config
    per_layer = full // len(layout.window_layers)
    main_bytes = per_layer * (len(layout.window_layers) - layout.num_window_layers)
    window_bytes = per_layer * layout.num_window_layers
    main = (int(config.cache.kv_cache_gb * 2**30) - layout.num_blocks * window_bytes) // main_bytes
    # A budget too small for the window pool beside more main blocks keeps one pool's count.
    return replace(config, cache=replace(config.cache, num_blocks=max(main, budget_blocks)))


class WindowGroup:
    """The window pool and its per-owner tables: allocation, caching, release and prefix checks."""

    def __init__(self, block_size: int, layout: WindowLayout) -> None:
        self.block_size = block_size
        self.window = layout.window
        self.layout = layout
        self.pool = BlockPool(layout.num_blocks)
        self._tables: dict[Hashable, list[KVBlock]] = {}
        # Block ids as handed out in plans: replaced, never mutated, when the table changes.
        self._ids: dict[Hashable, list[int]] = {}
        # Leading entries already released (all null), so a slide looks only at the new ones.
        self._released: dict[Hashable, int] = {}

    def first_needed(self, next_pos: int) -> int:
        """Index of the first block a row at ``next_pos`` or later can still see."""
        return max(0, next_pos - self.window + 1) // self.block_size

    def usable_hit(self, block_hashes: Sequence[bytes], num_hits: int) -> int:
        """The longest j <= num_hits whose window parts (blocks a row at j * block_size sees) are cached."""
        cached, j = self.pool.cached, num_hits
        while j > 0:
            first = self.first_needed(j * self.block_size)
            missing = next((k for k in range(j - 1, first - 1, -1) if block_hashes[k] not in cached), None)
            if missing is None:
                return j
            j = missing             # every point between needs block ``missing`` too
        return 0

    def can_grow(self, owner: Hashable, hit_hashes: Sequence[bytes], num_blocks: int, num_loaded: int = 0) -> bool:
        """Whether ``grow`` can succeed: every needed hit's window part present, and room for the rest."""
        held = len(self._tables.get(owner, ()))
        start = held + len(hit_hashes)
        first = self._first_at_admission(held, len(hit_hashes), num_loaded)
        revived = 0
        for h in hit_hashes[max(0, first - held):]:
            block = self.pool.get_cached_block(h)
            if block is None:
                return False
            revived += block.ref_cnt == 0
        return num_blocks - max(start, first) <= self.pool.num_free_blocks - revived

    def grow(self, owner: Hashable, hit_hashes: Sequence[bytes], num_blocks: int, num_loaded: int = 0) -> None:
        """Extend the owner's table to ``num_blocks`` entries: hits (their window parts where still
        seen, else null), then ``num_loaded`` blocks a KV connector loads (a window block where a
        row after them sees it, else null), then new blocks. Call only after ``can_grow`` said yes."""
        table = self._tables.setdefault(owner, [])
        held = len(table)
        if hit_hashes or num_loaded:
            first = self._first_at_admission(held, len(hit_hashes), num_loaded)
            for i, h in enumerate(hit_hashes, start=held):
                if i < first:
                    table.append(self.pool.null_block)
                else:
                    block = self.pool.get_cached_block(h)
                    self.pool.touch([block])
                    table.append(block)
            table.extend([self.pool.null_block] * max(0, first - len(table)))
            self._released[owner] = max(self._released.get(owner, 0), first)
        if num_blocks > len(table):
            table.extend(self.pool.get_new_blocks(num_blocks - len(table)))
        if len(table) != held or owner not in self._ids:
            self._ids[owner] = [b.block_id for b in table]

    def _first_at_admission(self, held: int, num_hits: int, num_loaded: int) -> int:
        """The first entry a row after ``num_hits`` hits and ``num_loaded`` loaded blocks sees
        (``held`` without either: every new entry is needed)."""
        if not (num_hits or num_loaded):
            return held
        return self.first_needed((held + num_hits + num_loaded) * self.block_size)

    def has_context(self, owner: Hashable, next_pos: int) -> bool:
        """Whether the owner holds the window parts a row at ``next_pos`` sees (no null entry among them)."""
        table = self._tables.get(owner, ())
        needed = table[self.first_needed(next_pos):-(-next_pos // self.block_size)]
        return all(b.block_id != NULL_BLOCK_ID for b in needed)

    def room_to_resume(self, owner: Hashable, keep: int, num_blocks: int) -> bool:
        """Whether the owner's table, cut to ``keep`` entries, can grow to ``num_blocks``."""
        spare = sum(1 for b in self._tables.get(owner, ())[keep:] if b.block_id != NULL_BLOCK_ID)
        return num_blocks - keep <= self.pool.num_free_blocks + spare

    def cache(self, owner: Hashable, block_hashes: Sequence[bytes], start: int, end: int) -> None:
        """Register the window parts of the owner's full blocks start..end-1 under their hashes."""
        table = self._tables.get(owner, ())
        for i in range(start, min(end, len(table))):
            if table[i].block_id != NULL_BLOCK_ID:
                self.pool.cache_block(table[i], block_hashes[i])

    def slide(self, owner: Hashable, next_pos: int) -> int:
        """Release the owner's blocks no row at ``next_pos`` or later can see; returns how many."""
        table = self._tables.get(owner)
        if table is None:
            return 0
        start, end = self._released.get(owner, 0), min(self.first_needed(next_pos), len(table))
        if end <= start:
            return 0
        gone = [table[i] for i in range(start, end) if table[i].block_id != NULL_BLOCK_ID]
        self.pool.free_blocks(gone)           # oldest first: evicted first
        table[start:end] = [self.pool.null_block] * (end - start)
        self._released[owner] = end
        self._ids[owner] = [b.block_id for b in table]
        return len(gone)

    def free(self, owner: Hashable, keep: int = 0) -> None:
        """Release the owner's entries from ``keep`` on, tail first (all of them by default)."""
        table = self._tables.get(owner)
        if table is None:
            return
        tail = [b for b in reversed(table[keep:]) if b.block_id != NULL_BLOCK_ID]
        self.pool.free_blocks(tail)
        if keep:
            del table[keep:]
            self._ids[owner] = [b.block_id for b in table]
            self._released[owner] = min(self._released.get(owner, 0), keep)
        else:
            self._forget(owner)

    def move(self, old: Hashable, new: Hashable) -> None:
        """Hand the owner's table to another owner (a request parking in, or resuming, a session)."""
        if old in self._tables:
            self._tables[new] = self._tables.pop(old)
            self._ids[new] = self._ids.pop(old)
            self._released[new] = self._released.pop(old, 0)

    def table(self, owner: Hashable) -> list[int] | None:
        """The owner's window block ids (shared, read-only; null entries are 0), or None."""
        return self._ids.get(owner)

    def num_held(self, owner: Hashable) -> int:
        """Window blocks the owner holds now (null entries aside)."""
        return sum(1 for b in self._tables.get(owner, ()) if b.block_id != NULL_BLOCK_ID)

    def stats(self) -> BlockPoolStats:
        """The window pool's counts (for metrics)."""
        return self.pool.stats()

    def _forget(self, owner: Hashable) -> None:
        self._tables.pop(owner, None)
        self._ids.pop(owner, None)
        self._released.pop(owner, None)
