"""The replica's live page: ``GET /dashboard`` (the page) and ``GET /dashboard/data`` (its JSON).

``ReplicaDashboard`` reads the generation service's engine stats, metrics registry, sessions and
the per-key usage table, keeps the last minutes of hit rates and load in a ``StatsRing`` (sampled
by a task on the app's lifespan), and builds one ``DashboardData`` per poll for one viewer: with
API keys, a key sees its own sessions and usage and the replica-wide gauges; the admin key
(``--admin-key``) sees every key's sessions (with a short owner digest) and usage. With keys, the
page itself is a 401 without one too, with a Basic challenge so that a browser asks for the key.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, NamedTuple

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from kvhive.core.dashboard_data import (
    DASHBOARD_CHALLENGE,
    MISSING_KEY_MESSAGE,
    Card,
    DashboardAccess,
    DashboardData,
    Series,
    StatsRing,
    rate_points,
)
from kvhive.core.dashboard_page import dashboard_html
from kvhive.core.tenancy import key_owner
from kvhive.server.context import background_task
from kvhive.server.dashboard_tables import (
    PREFILL_SECONDS_SUM,
    PROMPT_TOKENS_TOTAL,
    SessionRow,
    engine_cards,
    metric_sums,
    prefill_saving,
    runtime_table,
    session_table,
    tier_cards,
    tier_table,
    usage_table,
)
from kvhive.server.dashboard_usage import NO_KEY, KeyUsage, KeyUsageMiddleware, KeyUsageTable
from kvhive.server.errors import APIError

if TYPE_CHECKING:
    from kvhive.engine.stats import EngineStats
    from kvhive.server.generation import GenerationService
    from kvhive.sessions.registry import Session

# Sessions whose blocks per tier one poll looks up (each lookup asks the engine loop and the tiers).
MAX_PLACEMENT_LOOKUPS = 32
# Characters of an owner's digest the admin sees.
OWNER_LABEL_CHARS = 8


class LoadSample(NamedTuple):
    """Cumulative hit counters and the load at one moment (one point of each series)."""

    device_hits: int
    device_queries: int
    store_hits: int
    store_queries: int
    kv_usage: float
    running: int
    waiting: int


def load_sample(stats: EngineStats) -> LoadSample:
    """The sample of one engine stats snapshot."""
    store_hits = sum(t.hit_tokens for t in stats.tiers)
    store_queries = stats.tiers[0].hit_tokens + stats.tiers[0].miss_tokens if stats.tiers else 0
    return LoadSample(stats.prefix_cache_hits_tokens, stats.prefix_cache_queries_tokens, store_hits,
                      store_queries, stats.kv_usage, stats.num_running, stats.num_waiting)


def load_series(samples: list[tuple[float, LoadSample]], with_store: bool) -> tuple[Series, ...]:
    """Hit rates per interval, device KV usage, running and waiting requests over the samples."""
    series = [Series("prefix_cache_hit_rate", "Prefix cache hit rate", "fraction",
                     rate_points([(t, (s.device_hits, s.device_queries)) for t, s in samples]))]
    if with_store:
        series.append(Series("store_cache_hit_rate", "Store tier hit rate", "fraction",
                             rate_points([(t, (s.store_hits, s.store_queries)) for t, s in samples])))
    series += [Series("device_kv_usage", "Device KV usage", "fraction",
                      tuple((t, round(s.kv_usage, 4)) for t, s in samples)),
               Series("requests_running", "Running requests", "count", tuple((t, s.running) for t, s in samples)),
               Series("requests_waiting", "Waiting requests", "count", tuple((t, s.waiting) for t, s in samples))]
    return tuple(series)


class Viewer(NamedTuple):
    """Who asks: the admin (or anyone, on a server without keys) sees everything; ``owner`` is the
    key's digest (None without keys)."""

    admin: bool
    owner: str | None


class ReplicaDashboard:
    """Builds the page's data for one viewer and samples the series (bounded: ``StatsRing``)."""

    def __init__(self, service: GenerationService, access: DashboardAccess,
                 usage: KeyUsageTable | None = None) -> None:
        self.service = service
        self.access = access
        self.usage = usage if usage is not None else KeyUsageTable()
        self.ring: StatsRing[LoadSample] = StatsRing()
        self._admin_owner = None if access.admin_key is None else key_owner(f"Bearer {access.admin_key}")

    def sample(self, now: float | None = None, stats: EngineStats | None = None) -> None:
        """Offer the engine's stats (``stats``, else read now) to the ring, kept if the last
        sample is old enough."""
        now = time.time() if now is None else now
        if self.ring.due(now):
            self.ring.offer(now, load_sample(self.service.engine.stats() if stats is None else stats))

    async def run_sampler(self) -> None:
        """Sample every ring interval until cancelled."""
        while True:
            self.sample()
            await asyncio.sleep(self.ring.interval_s)

    def viewer(self, key: str | None) -> Viewer:
        """Who ``key`` (a valid key, or None on a server without keys) is."""
        return Viewer(self.access.is_admin(key) or not self.access.needs_key,
                      None if key is None else key_owner(f"Bearer {key}"))

    def owner_label(self, owner: str | None) -> str:
        """How the page names an owner: "admin", a short digest, or NO_KEY."""
        if owner is None or owner == NO_KEY:
            return NO_KEY
        return "admin" if owner == self._admin_owner else owner[:OWNER_LABEL_CHARS]

    async def data(self, key: str | None) -> DashboardData:
        """What ``key`` (a valid key, or None on a server without keys) may see now."""
        engine = self.service.engine
        stats = engine.stats()
        self.sample(stats=stats)
        viewer = self.viewer(key)
        sessions = self.visible_sessions(viewer)
        sums = metric_sums(self.service.metrics.registry, (PREFILL_SECONDS_SUM, PROMPT_TOKENS_TOTAL))
        cards = [*engine_cards(stats, prefill_saving(stats, sums)), *tier_cards(stats),
                 Card("sessions_live", "Live sessions" if viewer.admin else "Live sessions (yours)",
                      len(sessions), "count")]
        show_owner = viewer.admin and self.access.needs_key
        tables = (tier_table(stats, engine.block_bytes),
                  session_table(await self.session_rows(sessions), [t.name for t in stats.tiers],
                                engine.block_bytes, show_owner),
                  usage_table(self.usage_rows(viewer)), runtime_table(engine.runtime_info()))
        return DashboardData(f"kvhive replica: {self.service.served_model_name}", time.time(), tuple(cards),
                             load_series(self.ring.samples(), bool(stats.tiers)), tables)

    def visible_sessions(self, viewer: Viewer) -> list[Session]:
        """Every live session for the admin (or without keys), else the viewer's own; soonest expiry first."""
        sessions = self.service.sessions
        shown = sessions.live_sessions() if viewer.admin else sessions.list(viewer.owner)
        return sorted(shown, key=lambda s: s.expires)

    async def session_rows(self, sessions: list[Session]) -> list[SessionRow]:
        """A row per session; the first MAX_PLACEMENT_LOOKUPS with their blocks per tier."""
        rows = []
        for i, session in enumerate(sessions):
            placed = None
            if i < MAX_PLACEMENT_LOOKUPS:
                placed = await self.service.engine.session_blocks_by_tier(
                    [bytes.fromhex(h) for h in session.block_hashes])
            rows.append(SessionRow(session, self.owner_label(session.owner), placed))
        return rows

    def usage_rows(self, viewer: Viewer) -> list[tuple[str, KeyUsage]]:
        """Every key's usage for the admin (or without keys), else the viewer's own row."""
        if viewer.admin:
            return [(self.owner_label(name), usage) for name, usage in self.usage.items()]
        own = None if viewer.owner is None else self.usage.get(viewer.owner)
        return [] if own is None else [(self.owner_label(viewer.owner), own)]


def dashboard_sampler(dashboard: ReplicaDashboard | None) -> contextlib.AbstractAsyncContextManager[None]:
    """Run the dashboard's sampler for the app's lifetime (nothing without a dashboard)."""
    return contextlib.nullcontext() if dashboard is None else background_task(dashboard.run_sampler())


def install_dashboard(app: FastAPI, dashboard: ReplicaDashboard) -> None:
    """Add the usage counter (call before the API-key middleware is added, so it runs inside it)
    and the two routes."""
    app.add_middleware(KeyUsageMiddleware, table=dashboard.usage, keyed=dashboard.access.needs_key)
    page = dashboard_html()

    @app.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard_page(raw_request: Request) -> Response:
        """The live page; with keys, only to a request with a valid one (a browser asks for it:
        ``unauthorized``). It holds no data: it polls ``/dashboard/data``, its browser sending the same key."""
        if dashboard.access.needs_key and dashboard.access.key_in(raw_request.headers) is None:
            return unauthorized()
        return HTMLResponse(page, headers={"cache-control": "no-store"})

    @app.get("/dashboard/data", response_model=None)
    async def dashboard_data(raw_request: Request) -> Response:
        """What the caller's key may see (``ReplicaDashboard.data``); 401 without a valid key
        when the server has keys."""
        key = dashboard.access.key_in(raw_request.headers)
        if key is None and dashboard.access.needs_key:
            return unauthorized()
        data = await dashboard.data(key)
        return JSONResponse(data.to_json(), headers={"cache-control": "no-store"})


def unauthorized() -> JSONResponse:
    """The 401 of a dashboard request without a valid key: OpenAI's error shape, with the Basic
    challenge a browser answers by asking for the key."""
    response = APIError(401, MISSING_KEY_MESSAGE, code="invalid_api_key").response()
    response.headers["www-authenticate"] = DASHBOARD_CHALLENGE
    return response
