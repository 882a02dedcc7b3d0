"""The offload connector's scheduler half over a TieredStore (``kvhive.sessions.durable`` builds the store).

Torch-free: it runs inside the scheduler. Policy:

- Lookup (admission): after the device prefix match, the longest continuation of the request's
  block hashes held in any tier (``TieredStore.lookup_prefix``, mixed tiers included). When every
  block of it sits in the memory tier, its payloads are taken now (immutable bytes, so a later
  eviction cannot take them away) and the load is synchronous: the worker copies them in layer
  by layer during the step. Otherwise the load is asynchronous: the request waits
  (WAITING_FOR_KV) while the worker fetches the objects (promoting them) on a background thread.
- Lookups never stall the engine loop on a slow tier: when the memory tier (if it is the top
  tier) does not hold every block, the tiers are asked on a lookup thread; the caller waits at
  most ``lookup_wait_s`` and otherwise hears "not known yet" (None) and asks again next step.
- One lookup per admission attempt: its result (and any payloads taken) is kept per request,
  for that request's ``num_computed_tokens``, until the request is admitted or finished; a
  request that waits for blocks asks again every step and gets the kept answer.
- Save (write-through on compute): every block a step computed and registered in the prefix
  cache is saved (CPU memory, and the write-through tiers: disk, Redis), so a block evicted from
  the device pool already has a copy below. Loaded blocks are never saved again, nor blocks whose
  retention priority is below ``min_priority`` (``--offload-min-priority``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from kvhive.connector.base import (
    ConnectorMeta,
    ConnectorStats,
    LoadSpec,
    SchedulerOutput,
    TierCounters,
    TierStats,
)
from kvhive.store.key import KeySpace, StoreKey
from kvhive.store.memory import MemoryStore
from kvhive.store.tiered import TieredStore

logger = logging.getLogger(__name__)
# Version, in store keys, of a store object's layout: one block of every layer in layer order,
# [num_layers, 2, block_size, kv_heads, head_dim], whether the engine keeps one pool or two.
KV_LAYOUT_VERSION = 1


@dataclass
class _Match:
    """A lookup result waiting for the scheduler's allocation."""

    keys: list[StoreKey]
    tiers: list[int]                 # tier of each matched block (longest prefix)
    num_queried: int                 # blocks asked of the tiers
    payloads: list[Any] | None       # memory-tier bytes for a synchronous load


@dataclass
class _Lookup:
    """One request's lookup for one (num_computed_tokens, num_tokens): in flight, then resolved."""

    asked_at: tuple[int, int]
    keys: list[StoreKey]                     # the request's keys after its device hits
    running: Future[list[int]] | None        # the tiers' answer while a lookup thread asks them
    match: _Match | None = None              # set once the answer is in (payloads taken)


class OffloadScheduler:
    """Scheduler half of the offload connector: lookups, load specs and saves over a TieredStore."""

    def __init__(self, store: TieredStore, key_space: KeySpace, block_bytes: int,
                 lookup_wait_s: float = 0.002, min_priority: int = 0) -> None:
        """``lookup_wait_s``: how long admission waits for a lookup of the slow tiers before
        leaving it to run in the background (the request then waits a step and asks again).
        ``min_priority``: blocks of a lower retention priority are not saved."""
        self.min_priority = min_priority
        self.store = store
        self.key_space = key_space
        self.block_size = key_space.block_size
        self.block_bytes = block_bytes
        self.lookup_wait_s = lookup_wait_s
        # The tier whose payloads are taken at lookup for synchronous loads (process memory).
        self._memory_tier = next((i for i, t in enumerate(store.tiers) if isinstance(t.store, MemoryStore)),
                                 None)
        # Tiers that may block (disk, network) are asked on a lookup thread, never on the loop.
        self._has_slow_tiers = any(not isinstance(t.store, MemoryStore) for t in store.tiers)
        self._lookup_threads: ThreadPoolExecutor | None = None    # started at the first slow lookup
        # request id -> its latest lookup; removed when the request is admitted or finished.
        self._lookups: dict[str, _Lookup] = {}
        self._loads: list[LoadSpec] = []           # recorded since the last build_connector_meta
        self._stats = ConnectorStats(tiers={t.name: TierCounters() for t in store.tiers})

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens after the device hits found in the tiers (whole blocks, leaving one token to
        compute), and whether the load is asynchronous; None tokens while the lookup runs."""
        B = self.block_size
        first = num_computed_tokens // B
        last = (request.num_tokens - 1) // B
        asked_at = (num_computed_tokens, request.num_tokens)
        lookup = self._lookups.get(request.request_id)
        if lookup is not None and lookup.asked_at != asked_at:
            self._forget(request.request_id)        # device hits changed: the old answer is stale
            lookup = None
        if first >= last:
            return 0, False
        if lookup is None:
            lookup = self._start_lookup(request.block_hashes[first:last], asked_at)
            self._lookups[request.request_id] = lookup
        if lookup.match is None:
            if lookup.running is not None and not lookup.running.done():
                return None, False
            lookup.match = self._resolve(lookup)
        match = lookup.match
        return len(match.keys) * B, match.payloads is None and bool(match.keys)

    def update_state_after_alloc(self, request: Any, block_ids: Sequence[int], num_external_tokens: int,
                                 window_block_ids: Sequence[int] | None = None) -> None:
        """Turn the request's kept match into a LoadSpec for ``block_ids`` (and their window
        entries, with a window pool); count the lookup."""
        lookup = self._forget(request.request_id)
        if lookup is None or lookup.match is None:
            return
        match = lookup.match
        num_blocks = num_external_tokens // self.block_size
        self._count_lookup(match, num_blocks)
        if num_blocks == 0:
            return
        if len(block_ids) != num_blocks:
            raise ValueError(f"request {request.request_id}: {len(block_ids)} blocks for "
                             f"{num_blocks} blocks of external KV")
        payloads = None if match.payloads is None else tuple(match.payloads[:num_blocks])
        window = None if window_block_ids is None else tuple(window_block_ids)
        self._loads.append(LoadSpec(request.request_id, tuple(block_ids), tuple(match.keys[:num_blocks]),
                                    payloads, window))
        if payloads is None:
            self._stats.async_loads += 1
        else:
            self._stats.sync_loads += 1

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMeta:
        """Loads recorded since the last call, and saves of the blocks the last steps computed."""
        cached = [b for b in scheduler_output.newly_cached if b.priority >= self.min_priority]
        self._stats.unsaved_low_priority += len(scheduler_output.newly_cached) - len(cached)
        saves = tuple((b.block_id, self.key_space.key(b.block_hash)) for b in cached)
        window = tuple(b.window_block_id for b in cached) if cached and cached[0].window_block_id is not None else ()
        self._stats.saved_blocks += len(saves)
        loads, self._loads = tuple(self._loads), []
        return ConnectorMeta(saves=saves, save_window_ids=window, loads=loads,
                             cancelled_loads=scheduler_output.cancelled_loads)

    def request_finished(self, request: Any, block_ids: Sequence[int]) -> bool:
        """Forget the request's lookup and its payloads; False: saves snapshot blocks before any
        reuse, nothing to hold."""
        self._forget(request.request_id)
        return False

    def num_held_lookups(self) -> int:
        """Requests whose lookup (and any payloads taken for it) the connector keeps."""
        return len(self._lookups)

    def close(self) -> None:
        """Stop the lookup threads (a lookup still running ends on its own; nobody reads it)."""
        if self._lookup_threads is not None:
            self._lookup_threads.shutdown(wait=False, cancel_futures=True)
            self._lookup_threads = None

    def stats(self) -> ConnectorStats:
        """The connector's own counters (a live object: copy what you keep)."""
        return self._stats

    def tier_stats(self) -> tuple[TierStats, ...]:
        """Per-tier counters for metrics: lookups in tokens from here, bytes and usage from the store."""
        out = []
        for tier, store_stats in zip(self.store.tiers, self.store.stats().values(), strict=True):
            counters = self._stats.tiers[tier.name]
            out.append(TierStats(tier.name, counters.hit_tokens, counters.miss_tokens, store_stats))
        return tuple(out)

    def _start_lookup(self, block_hashes: Sequence[bytes], asked_at: tuple[int, int]) -> _Lookup:
        """Ask the tiers; a lookup that needs a slow tier runs on a thread, waited for briefly."""
        keys = self.key_space.keys(block_hashes)
        if self._memory_tier == 0 and all(self.store.tiers[0].store.contains(keys)):
            return _Lookup(asked_at, keys, None, self._resolve_tiers(keys, [0] * len(keys)))
        if not self._has_slow_tiers:
            return _Lookup(asked_at, keys, None, self._resolve_tiers(keys, self.store.lookup_prefix(keys)))
        if self._lookup_threads is None:
            self._lookup_threads = ThreadPoolExecutor(2, thread_name_prefix="kvhive-kv-lookup")
        running = self._lookup_threads.submit(self.store.lookup_prefix, keys)
        wait([running], timeout=self.lookup_wait_s)
        return _Lookup(asked_at, keys, running)

    def _resolve(self, lookup: _Lookup) -> _Match:
        """The match of a finished background lookup; a failed one is a miss."""
        try:
            tiers = lookup.running.result()
        except Exception:  # noqa: BLE001 - a failed lookup is a miss, never a dead engine
            logger.exception("KV tier lookup failed; treating it as a miss")
            tiers = []
        return self._resolve_tiers(lookup.keys, tiers)

    def _resolve_tiers(self, keys: list[StoreKey], tiers: list[int]) -> _Match:
        """The match for a lookup's answer; an all-memory prefix takes its payloads now."""
        match = _Match(keys[:len(tiers)], tiers, len(keys), None)
        if tiers and all(t == self._memory_tier for t in tiers):
            payloads = self._take_from_memory(match.keys)
            match.keys, match.tiers = match.keys[:len(payloads)], tiers[:len(payloads)]
            match.payloads = payloads or None
        return match

    def _forget(self, request_id: str) -> _Lookup | None:
        """Drop a request's lookup (its payloads go with it); a queued background one is cancelled."""
        lookup = self._lookups.pop(request_id, None)
        if lookup is not None and lookup.running is not None:
            lookup.running.cancel()
        return lookup

    def _take_from_memory(self, keys: Sequence[StoreKey]) -> list[Any]:
        """Payloads of the leading keys still in the memory tier with the right size."""
        memory = self.store.tiers[self._memory_tier].store
        payloads = []
        for key in keys:
            payload = memory.get(key)
            if payload is None or memoryview(payload).nbytes != self.block_bytes:
                break
            payloads.append(payload)
        return payloads

    def _count_lookup(self, match: _Match, num_used: int) -> None:
        # Tier t was asked for every queried block the tiers above it did not supply.
        B, used = self.block_size, match.tiers[:num_used]
        supplied_above = 0
        for index, tier in enumerate(self.store.tiers):
            hits = sum(1 for t in used if t == index)
            counters = self._stats.tiers[tier.name]
            counters.hit_tokens += hits * B
            counters.miss_tokens += (match.num_queried - supplied_above - hits) * B
            supplied_above += hits
