"""Collectors that read state at each scrape: the engine's stats, sessions and stored responses.

Core classes return stats and keep no Prometheus objects; these collectors turn one snapshot into
metric families each time ``/metrics`` is scraped (the engine loop refreshes that snapshot after each
step and, while idle, every ``IDLE_STATS_REFRESH_S``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector

from kvhive.server.metrics_kv_transfer import kv_transfer_metrics

if TYPE_CHECKING:
    from kvhive.engine.speculative.draft_proposals import SpecDecodeStats
    from kvhive.engine.stats import ConnectorCounters, EngineStats
    from kvhive.kv.pool import BlockPoolStats
    from kvhive.sessions.registry import SessionStats
    from kvhive.sessions.response_store import ResponseStats

logger = logging.getLogger(__name__)


def model_families(labels: list[str], gauges, counters) -> Iterator[Metric]:
    """One gauge or counter family per ``(name, doc, value)``, labelled with the model name only."""
    for family_type, rows in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
        for name, doc, value in rows:
            family = family_type(name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            yield family


class EngineStatsCollector(Collector):
    """Turns one ``EngineStats`` snapshot into gauges and counters at each scrape."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self._stats = stats
        self._labels = [model_name]

    def collect(self) -> Iterator[Metric]:
        """Read the engine's stats once and yield them (nothing if the engine cannot answer)."""
        try:
            s = self._stats()
        except Exception:  # noqa: BLE001 - a scrape must not fail because the engine is down
            logger.exception("engine.stats() failed; engine metrics left out of this scrape")
            return
        gauges = (
            ("kvhive_num_requests_running", "Requests in the running batch.", s.num_running),
            ("kvhive_num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            ("kvhive_kv_cache_usage_perc", "Fraction of device KV blocks in use (0..1).", s.kv_usage),
            ("kvhive_cache_num_blocks", "Device KV blocks in the pool.", s.num_blocks),
            ("kvhive_cache_block_size", "Tokens per KV block.", s.block_size),
        )
        counters = (
            ("kvhive_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             s.prefix_cache_queries_tokens),
            ("kvhive_prefix_cache_hits", "Prompt tokens served from the prefix cache.",
             s.prefix_cache_hits_tokens),
            ("kvhive_num_preemptions", "Requests preempted (to be recomputed) for lack of blocks.",
             s.num_preemptions),
        )
        yield from model_families(self._labels, gauges, counters)
        blocks = GaugeMetricFamily("kvhive_kv_blocks", "Device KV blocks by state: free (empty), cached (a "
                                   "reusable prefix nobody holds, evicted on demand), used (held by a request "
                                   "or an idle session); the three add up to the pool's usable blocks.",
                                   labels=["model_name", "state"])
        for state, count in (("free", s.free_blocks), ("cached", s.cached_blocks), ("used", s.used_blocks)):
            blocks.add_metric(self._labels + [state], count)
        yield blocks
        if s.window_pool is not None:
            yield self._window_blocks(s.window_pool)
        yield from self._tier_metrics(s)
        if s.kv_transfer is not None:
            yield from kv_transfer_metrics(self._labels, s.kv_transfer)
        if s.spec_decode is not None:
            yield from self._spec_decode(s.spec_decode)

    def _spec_decode(self, spec: SpecDecodeStats) -> Iterator[Metric]:
        """The speculative-decoding counters (``--speculative-config``), the per-position one labelled."""
        yield from model_families(self._labels, (), (
            ("kvhive_spec_decode_num_drafts", "Decode steps that verified draft tokens.", spec.num_drafts),
            ("kvhive_spec_decode_num_draft_tokens", "Draft tokens verified by the target model.",
             spec.num_draft_tokens),
            ("kvhive_spec_decode_num_accepted_tokens", "Draft tokens the target model accepted.",
             spec.num_accepted_tokens),
            ("kvhive_spec_decode_num_history_draft_tokens", "Draft tokens verified that came from the "
             "tenant's running requests or history (method history).", spec.num_history_draft_tokens),
            ("kvhive_spec_decode_num_history_accepted_tokens", "Draft tokens from the tenant's running "
             "requests or history that the target model accepted.", spec.num_history_accepted_tokens),
        ))
        per_pos = CounterMetricFamily(
            "kvhive_spec_decode_num_accepted_tokens_per_pos", "Draft tokens the target model accepted, by "
            "their position in the step's draft (0: the first).", labels=["model_name", "position"])
        for position, count in enumerate(spec.num_accepted_tokens_per_pos):
            per_pos.add_metric(self._labels + [str(position)], count)
        yield per_pos

    def _window_blocks(self, pool: BlockPoolStats) -> Metric:
        """The window layers' own pool by state, as ``kvhive_kv_blocks`` counts the main pool."""
        window = GaugeMetricFamily("kvhive_window_kv_blocks", "Blocks of the window layers' own KV pool (models "
                                   "with sliding-window layers) by state: free, cached, used.",
                                   labels=["model_name", "state"])
        for state, count in (("free", pool.num_free - pool.num_evictable), ("cached", pool.num_evictable),
                             ("used", pool.num_used)):
            window.add_metric(self._labels + [state], count)
        return window

    def _tier_metrics(self, s: EngineStats) -> Iterator[Metric]:
        """Per-tier KV store metrics (label ``tier``: cpu, disk, redis) and connector counters."""
        if not s.tiers:
            return
        labels = ["model_name", "tier"]
        counters = (
            ("kvhive_kv_tier_hit_tokens", "Prompt tokens this tier supplied at admission.",
             lambda t: t.hit_tokens),
            ("kvhive_kv_tier_miss_tokens", "Prompt tokens asked of this tier that it did not hold.",
             lambda t: t.miss_tokens),
            ("kvhive_kv_tier_bytes_in", "Block bytes written into this tier.", lambda t: t.store.bytes_in),
            ("kvhive_kv_tier_bytes_out", "Block bytes read from this tier.", lambda t: t.store.bytes_out),
            ("kvhive_kv_tier_evictions", "Blocks this tier dropped to stay within its budget.",
             lambda t: t.store.evictions),
            ("kvhive_kv_tier_errors", "Failed calls and corrupt objects in this tier (each a miss).",
             lambda t: t.store.errors),
            ("kvhive_kv_tier_write_errors", "Writes this tier failed (disk full, I/O error): blocks refused.",
             lambda t: t.store.write_errors),
        )
        for name, doc, value in counters:
            family = CounterMetricFamily(name, doc, labels=labels)
            for tier in s.tiers:
                family.add_metric(self._labels + [tier.name], value(tier))
            yield family
        # The first tier is asked for every block past the device hit; each tier supplies some.
        first = s.tiers[0]
        yield from model_families(self._labels, (), (
            ("kvhive_store_prefix_cache_queries", "Prompt tokens looked up in the store tiers (past the "
             "device prefix cache).", first.hit_tokens + first.miss_tokens),
            ("kvhive_store_prefix_cache_hits", "Prompt tokens the store tiers supplied.",
             sum(t.hit_tokens for t in s.tiers)),
        ))
        latency = SummaryMetricFamily("kvhive_kv_tier_load_seconds", "Time spent reading blocks from this tier.",
                                      labels=labels)
        usage = GaugeMetricFamily("kvhive_kv_tier_usage_bytes", "Bytes this tier holds.", labels=labels)
        budget = GaugeMetricFamily("kvhive_kv_tier_budget_bytes", "Byte budget of this tier.", labels=labels)
        for tier in s.tiers:
            tier_labels = self._labels + [tier.name]
            latency.add_metric(tier_labels, tier.store.load_count, tier.store.load_seconds_sum)
            if tier.store.used_bytes is not None:
                usage.add_metric(tier_labels, tier.store.used_bytes)
            if tier.store.budget_bytes is not None:
                budget.add_metric(tier_labels, tier.store.budget_bytes)
        yield from (latency, usage, budget)
        if s.connector is not None:
            yield from self._connector_metrics(s.connector)

    def _connector_metrics(self, c: ConnectorCounters) -> Iterator[Metric]:
        """The KV connector's load and save counters and its asynchronous load time."""
        for name, doc, value in (
            ("kvhive_kv_connector_sync_loads", "KV loads copied in during the step (memory tier).", c.sync_loads),
            ("kvhive_kv_connector_async_loads", "KV loads fetched while the request waited.", c.async_loads),
            ("kvhive_kv_connector_failed_load_blocks", "Blocks a load could not supply (recomputed).",
             c.failed_load_blocks),
            ("kvhive_kv_connector_saved_blocks", "Blocks handed to the KV writer.", c.saved_blocks),
            ("kvhive_kv_connector_dropped_save_blocks", "Blocks not saved because the writer fell behind.",
             c.dropped_save_blocks),
            ("kvhive_kv_connector_unsaved_low_priority_blocks", "Blocks not saved: their retention priority "
             "is below --offload-min-priority.", c.unsaved_low_priority),
        ):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(self._labels, value)
            yield family
        wait = SummaryMetricFamily("kvhive_kv_connector_async_load_seconds",
                                   "Wall time of asynchronous KV loads (request parked meanwhile).",
                                   labels=["model_name"])
        wait.add_metric(self._labels, c.async_load_count, c.async_load_seconds_sum)
        yield wait


class SessionStatsCollector(Collector):
    """Session metrics at each scrape: the registry's counts, and where the sessions' blocks are."""

    def __init__(self, sessions: Callable[[], SessionStats], engine_stats: Callable[[], EngineStats],
                 pinned_by_tier: Callable[[], dict[str, int]], model_name: str) -> None:
        self._sessions = sessions
        self._engine_stats = engine_stats
        self._pinned_by_tier = pinned_by_tier
        self._labels = [model_name]

    def collect(self) -> Iterator[Metric]:
        """Read the registry, the engine snapshot and the store's pins once; yield the families."""
        try:
            s, e, pinned = self._sessions(), self._engine_stats(), self._pinned_by_tier()
        except Exception:  # noqa: BLE001 - a scrape must not fail because a tier is down
            logger.exception("session stats failed; session metrics left out of this scrape")
            return
        gauges = (
            ("kvhive_sessions_live", "Sessions not expired (busy ones included).", s.num_live),
            ("kvhive_session_tokens", "Tokens the live sessions hold (prompt + output of their last turn).",
             s.num_tokens),
        )
        counters = (
            ("kvhive_session_turns", "Turns finished in a session.", s.turns_total),
            ("kvhive_session_hit_tokens", "Prompt tokens of session turns served from cached KV.",
             s.hit_tokens_total),
            ("kvhive_session_expiries", "Sessions dropped at their expiry (their blocks released).",
             s.expired_total),
            ("kvhive_session_deletes", "Sessions ended by DELETE or end_conversation.", s.deleted_total),
            ("kvhive_session_forks", "Sessions made by POST /v1/context/{id}/fork.", s.forks_total),
            ("kvhive_session_conversation_evictions", "Idle conversations ended to make room for a new one "
             "(--max-active-conversations).", s.evicted_total),
            ("kvhive_session_record_write_errors", "Session records the disk could not take (each request "
             "answered 507).", s.record_write_errors_total),
            ("kvhive_session_spills", "Idle session holdings released from the device pool under pressure.",
             e.num_session_spills),
        )
        yield from model_families(self._labels, gauges, counters)
        # device: blocks idle sessions hold in the pool; a store tier: pinned blocks it holds.
        blocks = GaugeMetricFamily("kvhive_session_blocks", "Session blocks held, by tier (device = pinned "
                                   "in the pool by idle sessions; a store tier = session-pinned blocks it holds).",
                                   labels=["model_name", "tier"])
        tokens = GaugeMetricFamily("kvhive_session_tier_tokens", "Tokens of the session blocks each tier holds.",
                                   labels=["model_name", "tier"])
        for tier, num_blocks in {"device": e.num_session_blocks, **pinned}.items():
            blocks.add_metric(self._labels + [tier], num_blocks)
            tokens.add_metric(self._labels + [tier], num_blocks * e.block_size)
        yield from (blocks, tokens)


class ResponseStatsCollector(Collector):
    """``/v1/responses`` metrics at each scrape: stored responses and conversations, responses created."""

    def __init__(self, stats: Callable[[], ResponseStats], model_name: str) -> None:
        self._stats = stats
        self._labels = [model_name]

    def collect(self) -> Iterator[Metric]:
        """Read the stats once; yield the gauges and the created counter (label ``status``)."""
        s = self._stats()
        gauges = (
            ("kvhive_responses_stored", "Stored responses this replica holds.", s.num_stored),
            ("kvhive_response_conversations", "Conversations of stored responses this replica holds.",
             s.num_conversations),
        )
        counters = (("kvhive_response_record_write_errors", "Stored responses the disk could not take (each "
                     "request answered 507 or response.failed).", s.write_errors_total),)
        yield from model_families(self._labels, gauges, counters)
        created = CounterMetricFamily("kvhive_responses_created", "Responses created, by final status "
                                      "(completed, incomplete, failed).", labels=["model_name", "status"])
        for status, count in sorted(s.created_total.items()):
            created.add_metric(self._labels + [status], count)
        yield created
