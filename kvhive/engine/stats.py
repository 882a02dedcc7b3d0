"""The engine's stats snapshot types: what ``LLMEngine.stats()`` returns and /metrics exports."""

from __future__ import annotations

from dataclasses import dataclass

from kvhive.connector.base import TierStats
from kvhive.connector.disagg.transfer_stats import KVTransferStats
from kvhive.engine.speculative.draft_proposals import SpecDecodeStats
from kvhive.kv.pool import BlockPoolStats


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for /metrics; the counters are cumulative."""

    num_running: int
    num_waiting: int
    kv_usage: float
    prefix_cache_queries_tokens: int
    prefix_cache_hits_tokens: int
    num_preemptions: int
    num_blocks: int
    block_size: int
    tiers: tuple[TierStats, ...] = ()       # one per store tier below the device pool, fastest first
    connector: ConnectorCounters | None = None
    num_session_blocks: int = 0             # device blocks pinned by idle sessions
    num_session_spills: int = 0             # session holdings released from the pool under pressure
    # Device blocks by state; free + cached + used == num_blocks - 1 (the null block aside).
    free_blocks: int = 0                    # empty: no request holds them, no prefix in them
    cached_blocks: int = 0                  # evictable: nobody holds them, a cached prefix is in them
    used_blocks: int = 0                    # held by a running request or an idle session
    kv_transfer: KVTransferStats | None = None   # --kv-role prefill|decode: the transfer counters
    window_pool: BlockPoolStats | None = None    # the window layers' own pool (kvhive.kv.window_group)
    spec_decode: SpecDecodeStats | None = None   # --speculative-config: drafts verified and accepted


@dataclass(frozen=True)
class ConnectorCounters:
    """KV connector counters (cumulative) for /metrics."""

    sync_loads: int                # loads whose bytes were in memory (copied during the step)
    async_loads: int               # loads fetched from a slow tier while the request waited
    failed_load_blocks: int        # blocks a load could not supply (missing, corrupt): recomputed
    saved_blocks: int              # blocks handed to the writer
    dropped_save_blocks: int       # saves skipped because the writer fell behind
    async_load_seconds_sum: float
    async_load_count: int
    unsaved_low_priority: int = 0  # blocks not saved: retention priority below --offload-min-priority


@dataclass(frozen=True)
class TierBudget:
    """The store tier that keeps pinned session blocks (the lowest with a byte budget) and its budget."""

    name: str              # "cpu" or "disk"
    budget_bytes: int
