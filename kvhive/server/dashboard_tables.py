"""The replica page's cards and tables, each built from one snapshot: the engine's stats, the
metrics registry, the sessions a viewer may see, the per-key usage and the runtime's kernel paths.

What a viewer may see is decided by the caller (``kvhive.server.dashboard_replica``); these builders only
shape what they are given. Numbers are the same ones ``/metrics``, ``/v1/context`` and ``/version``
answer, so the page and those endpoints agree.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from kvhive.core.dashboard_data import Card, Cell, Table, bounded_table
from kvhive.server.dashboard_usage import KeyUsage

if TYPE_CHECKING:
    from kvhive.engine.stats import EngineStats
    from kvhive.sessions.registry import Session

# Metric samples the page reads from the registry: the prefill time of finished requests and their
# prompt tokens (what prefill_seconds_saved is measured from).
PREFILL_SECONDS_SUM = "kvhive_request_prefill_time_seconds_sum"
PROMPT_TOKENS_TOTAL = "kvhive_prompt_tokens_total"


def metric_sums(registry: CollectorRegistry, names: Iterable[str]) -> dict[str, float]:
    """Each named sample summed over its label sets, from one collection of ``registry`` (0 if absent)."""
    wanted = dict.fromkeys(names, 0.0)
    for family in registry.collect():
        for sample in family.samples:
            if sample.name in wanted:
                wanted[sample.name] += sample.value
    return wanted


@dataclass(frozen=True)
class PrefillSaving:
    """Prefill time the cache saved: cached prompt tokens times the measured prefill time per
    computed token (finished requests' prefill seconds over their prompt tokens not cached)."""

    cached_tokens: int
    seconds_per_token: float

    @property
    def seconds_saved(self) -> float:
        """The estimate in seconds."""
        return self.cached_tokens * self.seconds_per_token


def prefill_saving(stats: EngineStats, sums: Mapping[str, float]) -> PrefillSaving:
    """The saving from the engine's hit counters and the registry's prefill time (``metric_sums``
    of PREFILL_SECONDS_SUM and PROMPT_TOKENS_TOTAL)."""
    cached = stats.prefix_cache_hits_tokens + sum(t.hit_tokens for t in stats.tiers)
    computed = sums[PROMPT_TOKENS_TOTAL] - cached
    per_token = sums[PREFILL_SECONDS_SUM] / computed if computed > 0 else 0.0
    return PrefillSaving(cached, per_token)


def hit_rate(hits: int, queries: int) -> float:
    """hits / queries, 0 when nothing was asked."""
    return round(hits / queries, 4) if queries > 0 else 0.0


def engine_cards(stats: EngineStats, saving: PrefillSaving) -> list[Card]:
    """Load, device fill, the prefix cache's counters and hit rate, and the prefill time saved."""
    cards = [
        Card("requests_running", "Running requests", stats.num_running, "count"),
        Card("requests_waiting", "Waiting requests", stats.num_waiting, "count"),
        Card("device_kv_usage", "Device KV usage", round(stats.kv_usage, 4), "fraction"),
        Card("prefix_cache_queries_tokens", "Prefix cache lookups", stats.prefix_cache_queries_tokens, "tokens"),
        Card("prefix_cache_hits_tokens", "Prefix cache hits", stats.prefix_cache_hits_tokens, "tokens"),
        Card("prefix_cache_hit_rate", "Prefix cache hit rate",
             hit_rate(stats.prefix_cache_hits_tokens, stats.prefix_cache_queries_tokens), "fraction"),
    ]
    if stats.tiers:
        first = stats.tiers[0]
        store_hits = sum(t.hit_tokens for t in stats.tiers)
        cards += [Card("store_cache_hits_tokens", "Store tier hits", store_hits, "tokens"),
                  Card("store_cache_hit_rate", "Store tier hit rate",
                       hit_rate(store_hits, first.hit_tokens + first.miss_tokens), "fraction")]
    cards += [Card("prefill_seconds_saved", "Prefill time saved", round(saving.seconds_saved, 3), "s"),
              Card("preemptions", "Preemptions", stats.num_preemptions, "count")]
    return cards


TIER_COLUMNS = ("tier", "used_bytes", "capacity_bytes", "fill", "hit_tokens", "miss_tokens")


def tier_table(stats: EngineStats, block_bytes: int) -> Table:
    """Fill and hits of the device pool and each store tier (None where a tier cannot tell, Redis)."""
    device_used = stats.used_blocks * block_bytes
    rows: list[Sequence[Cell]] = [("device", device_used, stats.num_blocks * block_bytes, round(stats.kv_usage, 4),
                                   stats.prefix_cache_hits_tokens,
                                   stats.prefix_cache_queries_tokens - stats.prefix_cache_hits_tokens)]
    for tier in stats.tiers:
        used, budget = tier.store.used_bytes, tier.store.budget_bytes
        fill = round(used / budget, 4) if used is not None and budget else None
        rows.append((tier.name, used, budget, fill, tier.hit_tokens, tier.miss_tokens))
    return bounded_table("tiers", "Tier fill", TIER_COLUMNS, rows)


def tier_cards(stats: EngineStats) -> list[Card]:
    """Bytes each store tier holds (cards ``tier_<name>_used_bytes``)."""
    return [Card(f"tier_{t.name}_used_bytes", f"{t.name} tier used", t.store.used_bytes, "bytes")
            for t in stats.tiers if t.store.used_bytes is not None]


@dataclass(frozen=True)
class SessionRow:
    """One visible session and, where looked up, its blocks per tier."""

    session: Session
    owner_label: str | None           # shown to the admin only (None: the column is left out)
    blocks_by_tier: Mapping[str, int] | None


def session_table(rows: Sequence[SessionRow], tier_names: Sequence[str], block_bytes: int,
                  show_owner: bool, now: float | None = None) -> Table:
    """The sessions: id, (owner), kind, tokens, blocks, bytes, blocks per tier, seconds to expiry."""
    now = time.time() if now is None else now
    places = ("device", *tier_names)
    columns = ("id", *(("owner",) if show_owner else ()), "kind", "tokens", "blocks", "bytes",
               *(f"{place}_blocks" for place in places), "expires_in_s")
    cells = []
    for row in rows:
        s = row.session
        placed = [None if row.blocks_by_tier is None else row.blocks_by_tier.get(p, 0) for p in places]
        cells.append((s.session_id, *((row.owner_label,) if show_owner else ()), s.kind, s.num_tokens,
                      len(s.block_hashes), len(s.block_hashes) * block_bytes, *placed,
                      max(0, int(s.expires - now))))
    return bounded_table("sessions", "Live sessions", columns, cells)


USAGE_COLUMNS = ("key", "requests", "prompt_tokens", "generation_tokens")


def usage_table(rows: Sequence[tuple[str, KeyUsage]]) -> Table:
    """Requests and tokens per key (``key``: a label, never the key)."""
    return bounded_table("usage", "Usage per API key", USAGE_COLUMNS,
                         [(label, u.requests, u.prompt_tokens, u.generation_tokens) for label, u in rows])


def runtime_table(info: Mapping[str, object]) -> Table:
    """Device, dtype and CPU kernel ISA level, then each op's path (``/version``'s data)."""
    rows: list[tuple[Cell, Cell]] = [(name, str(info.get(name) or "-")) for name in ("device", "dtype", "cpu_isa")]
    paths = info.get("paths") or {}
    if isinstance(paths, Mapping):
        rows += [(f"path:{op}", str(path)) for op, path in sorted(paths.items())]
    return bounded_table("runtime", "Kernel paths and ISA", ("item", "value"), rows)
