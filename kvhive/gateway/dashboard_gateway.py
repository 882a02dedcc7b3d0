"""The gateway's live page: ``GET /dashboard`` (the page every kvhive process serves) and
``GET /dashboard/data``: each replica's health, routing state, load, requests in flight, share of
the routed requests and the reasons they were routed there.

The numbers are the ones ``/health`` and ``/metrics`` answer: health and load as the health checks
last saw them, routed requests from ``kvhive_gateway_routing_decisions``. The series are sampled
when the page polls (at most one sample per ``SAMPLE_INTERVAL_S``, the last minutes kept).
The gateway holds no API keys of its own (it forwards the client's): its page and data are open
unless ``--admin-key`` is given, then only that key opens them (401 otherwise, asking a browser for it).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

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
    Table,
    bounded_table,
)
from kvhive.core.dashboard_page import dashboard_html
from kvhive.gateway.metrics import GatewayMetrics
from kvhive.gateway.replicas import Replica
from kvhive.routing.dialects import GATEWAY_ROUTE, openai_error

REPLICA_COLUMNS = ("replica", "health", "routing", "running", "waiting", "kv_usage", "inflight", "routed", "share")
REASON_COLUMNS = ("replica", "reason", "requests")


class RoutedCounts(NamedTuple):
    """Requests routed so far, by replica and by (replica, reason)."""

    by_replica: Counter[str]
    by_reason: Counter[tuple[str, str]]

    @property
    def total(self) -> int:
        """Every routed request (retries and prefill hops count as their own)."""
        return sum(self.by_replica.values())


def routed_counts(metrics: GatewayMetrics) -> RoutedCounts:
    """The routing-decision counter's values (what /metrics exports as kvhive_gateway_routing_decisions_total)."""
    by_replica: Counter[str] = Counter()
    by_reason: Counter[tuple[str, str]] = Counter()
    for family in metrics.decisions.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                replica, reason = sample.labels["replica"], sample.labels["reason"]
                by_replica[replica] += int(sample.value)
                by_reason[replica, reason] += int(sample.value)
    return RoutedCounts(by_replica, by_reason)


def replica_table(replicas: Sequence[Replica], routed: RoutedCounts, now: float) -> Table:
    """One row per replica: health, routing state, load, in flight, routed and its share."""
    total = routed.total
    rows = [(r.name, "up" if r.healthy else "down", r.outlier.state(now), r.load.running, r.load.waiting,
             round(r.load.kv_usage, 4), r.inflight, routed.by_replica[r.name],
             round(routed.by_replica[r.name] / total, 4) if total else 0.0) for r in replicas]
    return bounded_table("replicas", "Replicas", REPLICA_COLUMNS, rows)


def reason_table(routed: RoutedCounts) -> Table:
    """Routed requests by replica and reason (session, kv, cache_key, load, retry, ...), most first."""
    rows = [(replica, reason, count) for (replica, reason), count in routed.by_reason.most_common()]
    return bounded_table("route_reasons", "Route reasons", REASON_COLUMNS, rows)


class GatewaySample(NamedTuple):
    """The routed total and the healthy replicas at one moment."""

    routed: int
    healthy: int


class GatewayDashboard:
    """Builds the gateway's page data from its replicas and metrics."""

    def __init__(self, replicas: Sequence[Replica], metrics: GatewayMetrics, access: DashboardAccess) -> None:
        self.replicas = replicas          # the live list: discovery adds and removes replicas in it
        self.metrics = metrics
        self.access = access
        self.ring: StatsRing[GatewaySample] = StatsRing()

    def data(self, now: float | None = None) -> DashboardData:
        """The page's data now (``now``: unix s)."""
        now = time.time() if now is None else now
        replicas = list(self.replicas)
        routed = routed_counts(self.metrics)
        healthy = sum(r.healthy for r in replicas)
        self.ring.offer(now, GatewaySample(routed.total, healthy))
        cards = (Card("replicas", "Replicas", len(replicas), "count"),
                 Card("replicas_healthy", "Healthy replicas", healthy, "count"),
                 Card("requests_routed", "Requests routed", routed.total, "count"),
                 Card("requests_inflight", "Requests in flight", sum(r.inflight for r in replicas), "count"))
        tables = (replica_table(replicas, routed, time.monotonic()), reason_table(routed))
        return DashboardData("kvhive gateway", now, cards, self.series(), tables)

    def series(self) -> tuple[Series, ...]:
        """Requests routed per second between samples, and healthy replicas, over the kept samples."""
        samples = self.ring.samples()
        rates = tuple((t1, round((s1.routed - s0.routed) / max(t1 - t0, 1e-9), 3))
                      for (t0, s0), (t1, s1) in zip(samples, samples[1:], strict=False))
        return (Series("requests_routed_per_s", "Requests routed", "req/s", rates),
                Series("replicas_healthy", "Healthy replicas", "count", tuple((t, s.healthy) for t, s in samples)))


def install_gateway_dashboard(app: FastAPI, dashboard: GatewayDashboard) -> None:
    """Add ``GET /dashboard`` (the page) and ``GET /dashboard/data``, both behind ``--admin-key``
    when one is given (Bearer, ``x-api-key`` or HTTP Basic's password: a browser asks for it)."""
    page = dashboard_html()
    access = dashboard.access

    def refused(request: Request) -> Response | None:
        """The 401 (OpenAI's shape, with the Basic challenge) of a request without the admin key, else None."""
        if not access.needs_key or access.key_in(request.headers) is not None:
            return None
        return openai_error(401, MISSING_KEY_MESSAGE.replace("API key", "admin key"), code="invalid_api_key",
                            headers={"www-authenticate": DASHBOARD_CHALLENGE})

    async def dashboard_page(request: Request) -> Response:
        """The live page (it holds no data: it polls ``/dashboard/data``, its browser sending the same key)."""
        return refused(request) or HTMLResponse(page, headers={"cache-control": "no-store"})

    async def dashboard_data(request: Request) -> Response:
        """The replicas' state; 401 without the admin key when one is set."""
        refusal = refused(request)
        if refusal is not None:
            return refusal
        return JSONResponse(dashboard.data().to_json(), headers={"cache-control": "no-store"})

    app.router.add_api_route("/dashboard", dashboard_page, methods=["GET"], include_in_schema=False, response_model=None,
                             route_class_override=GATEWAY_ROUTE)
    app.router.add_api_route("/dashboard/data", dashboard_data, methods=["GET"], response_model=None,
                             route_class_override=GATEWAY_ROUTE)
