"""The offload connector's scheduler half over a TieredStore, and the store built from StoreConfig.

Torch-free: it runs inside the scheduler. Policy:

- Lookup (admission): after the device prefix match, the longest continuation of the request's
  block hashes held in any tier (``TieredStore.lookup_prefix``, mixed tiers included). When every
  block of it sits in the memory tier, its payloads are taken now (immutable bytes, so a later
  eviction cannot take them away) and the load is synchronous: the worker copies them in layer
  by layer during the step. Otherwise the load is asynchronous: the request waits
  (WAITING_FOR_KV) while the worker fetches the objects (promoting them) on a background thread.
- Save (write-through on compute): every block a step computed and registered in the prefix
  cache is saved (CPU memory, and the write-through tiers: disk, Redis), so a block evicted from
  the device pool already has a copy below. Loaded blocks are never saved again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvhive.config import StoreConfig
from kvhive.connector.base import (
    ConnectorMeta,
    ConnectorStats,
    LoadSpec,
    SchedulerOutput,
    TierCounters,
    TierStats,
)
from kvhive.store.disk import DiskStore
from kvhive.store.key import KeySpace, StoreKey
from kvhive.store.memory import MemoryStore
from kvhive.store.tiered import Tier, TieredStore

# Version of the pool block layout [num_layers, 2, block_size, kv_heads, head_dim] in store keys.
KV_LAYOUT_VERSION = 1
_GB = 2**30


def build_tiered_store(config: StoreConfig) -> TieredStore | None:
    """CPU memory -> disk -> Redis, as configured; None when no tier is.

    Disk and Redis are write-through: every saved block reaches them at once, so the disk tier
    survives a kill of the process and Redis serves other replicas without waiting for evictions.
    """
    tiers: list[Tier] = []
    if config.cpu_offload_gb > 0:
        tiers.append(Tier("cpu", MemoryStore(int(config.cpu_offload_gb * _GB))))
    if config.disk_cache_dir is not None:
        tiers.append(Tier("disk", DiskStore(config.disk_cache_dir, int(config.disk_cache_gb * _GB)),
                          write_through=True))
    if config.redis_url is not None:
        from kvhive.store.redis import RedisStore

        tiers.append(Tier("redis", RedisStore(config.redis_url, ttl_seconds=config.redis_ttl_s,
                                              timeout_s=config.redis_timeout_s), write_through=True))
    return TieredStore(tiers) if tiers else None


@dataclass
class _Match:
    """A lookup result waiting for the scheduler's allocation."""

    keys: list[StoreKey]
    tiers: list[int]                 # tier of each matched block (longest prefix)
    num_queried: int                 # blocks asked of the tiers
    payloads: list[Any] | None       # memory-tier bytes for a synchronous load


class OffloadScheduler:
    """Scheduler half of the offload connector: lookups, load specs and saves over a TieredStore."""

    def __init__(self, store: TieredStore, key_space: KeySpace, block_bytes: int) -> None:
        self.store = store
        self.key_space = key_space
        self.block_size = key_space.block_size
        self.block_bytes = block_bytes
        # The tier whose payloads are taken at lookup for synchronous loads (process memory).
        self._memory_tier = next((i for i, t in enumerate(store.tiers) if isinstance(t.store, MemoryStore)),
                                 None)
        self._pending: dict[str, _Match] = {}      # request id -> latest lookup, until allocation
        self._loads: list[LoadSpec] = []           # recorded since the last build_connector_meta
        self._stats = ConnectorStats(tiers={t.name: TierCounters() for t in store.tiers})

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens after the device hits found in the tiers (whole blocks, leaving one token to
        compute), and whether the load is asynchronous."""
        B = self.block_size
        first = num_computed_tokens // B
        last = (request.num_tokens - 1) // B
        self._pending.pop(request.request_id, None)
        if first >= last:
            return 0, False
        keys = self.key_space.keys(request.block_hashes[first:last])
        tiers = self.store.lookup_prefix(keys)
        match = _Match(keys[:len(tiers)], tiers, len(keys), None)
        self._pending[request.request_id] = match
        if tiers and all(t == self._memory_tier for t in tiers):
            payloads = self._take_from_memory(match.keys)
            if payloads:
                match.keys, match.tiers, match.payloads = match.keys[:len(payloads)], tiers[:len(payloads)], payloads
                return len(payloads) * B, False
            match.keys, match.tiers = [], []
        return len(match.keys) * B, bool(match.keys)

    def update_state_after_alloc(self, request: Any, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """Turn the request's pending match into a LoadSpec for ``block_ids``; count the lookup."""
        match = self._pending.pop(request.request_id, None)
        if match is None:
            return
        num_blocks = num_external_tokens // self.block_size
        self._count_lookup(match, num_blocks)
        if num_blocks == 0:
            return
        if len(block_ids) != num_blocks:
            raise ValueError(f"request {request.request_id}: {len(block_ids)} blocks for "
                             f"{num_blocks} blocks of external KV")
        payloads = None if match.payloads is None else tuple(match.payloads[:num_blocks])
        self._loads.append(LoadSpec(request.request_id, tuple(block_ids), tuple(match.keys[:num_blocks]),
                                    payloads))
        if payloads is None:
            self._stats.async_loads += 1
        else:
            self._stats.sync_loads += 1

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMeta:
        """Loads recorded since the last call, and saves of the blocks the last steps computed."""
        saves = tuple((b.block_id, self.key_space.key(b.block_hash)) for b in scheduler_output.newly_cached)
        self._stats.saved_blocks += len(saves)
        loads, self._loads = tuple(self._loads), []
        return ConnectorMeta(saves=saves, loads=loads)

    def request_finished(self, request: Any, block_ids: Sequence[int]) -> bool:
        """Forget a pending match; False: saves snapshot blocks before any reuse, nothing to hold."""
        self._pending.pop(request.request_id, None)
        return False

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
