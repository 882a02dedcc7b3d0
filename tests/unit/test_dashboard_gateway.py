"""The gateway's live page, on an app built in process: each replica's health, load and share of
the routed requests with their reasons; open without --admin-key, page and data 401 without it when set
(Bearer, x-api-key or Basic), 404 with --no-dashboard; and the gateway's flags."""

from __future__ import annotations

import asyncio
import base64

import httpx
import pytest

from kvhive.core.dashboard_data import DashboardAccess
from kvhive.routing.scorer import LoadStats

REPLICAS = ("http://127.0.0.1:9", "http://127.0.0.1:10")


def gateway_app(tokenizer, access: DashboardAccess):
    from kvhive.gateway.app import create_gateway_app
    from kvhive.gateway.gateway_config import GatewayConfig, ReplicaSpec

    return create_gateway_app(GatewayConfig(tuple(ReplicaSpec(url) for url in REPLICAS)), tokenizer,
                              dashboard=access)


def get(app, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
    async def scenario() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
            return await client.get(path, headers=headers)
    return asyncio.run(scenario())


def table(data: dict, table_id: str) -> list[dict]:
    """A table's rows as column -> cell."""
    found = next(t for t in data["tables"] if t["id"] == table_id)
    return [dict(zip(found["columns"], row, strict=True)) for row in found["rows"]]


def test_the_data_lists_each_replica_with_health_load_and_share(tokenizer) -> None:
    app = gateway_app(tokenizer, DashboardAccess())
    gateway = app.state.gateway
    first, second = gateway.replicas.replicas
    first.healthy, first.load = True, LoadStats(running=2, waiting=1, kv_usage=0.25)
    for reason, count in (("kv", 3), ("session", 1)):
        gateway.metrics.decisions.labels(first.name, reason).inc(count)
    gateway.metrics.decisions.labels(second.name, "load").inc(4)
    assert get(app, "/dashboard").text.startswith("<!doctype html>")
    answer = get(app, "/dashboard/data")
    assert answer.status_code == 200 and answer.headers["cache-control"] == "no-store"
    data = answer.json()
    cards = {c["id"]: c["value"] for c in data["cards"]}
    assert cards == {"replicas": 2, "replicas_healthy": 1, "requests_routed": 8, "requests_inflight": 0}
    rows = {row["replica"]: row for row in table(data, "replicas")}
    assert rows[first.name] == {"replica": first.name, "health": "up", "routing": "ok", "running": 2, "waiting": 1,
                                "kv_usage": 0.25, "inflight": 0, "routed": 4, "share": 0.5}
    assert rows[second.name]["health"] == "down" and rows[second.name]["share"] == 0.5
    reasons = {(r["replica"], r["reason"]): r["requests"] for r in table(data, "route_reasons")}
    assert reasons == {(first.name, "kv"): 3, (first.name, "session"): 1, (second.name, "load"): 4}
    metrics = get(app, "/metrics").text
    assert f'kvhive_gateway_routing_decisions_total{{reason="kv",replica="{first.name}"}} 3.0' in metrics


def test_the_admin_key_guards_the_page_and_the_data(tokenizer) -> None:
    app = gateway_app(tokenizer, DashboardAccess(admin_key="adm"))
    wrong_basic = {"Authorization": "Basic " + base64.b64encode(b"x:nope").decode()}
    for path in ("/dashboard", "/dashboard/data"):
        for headers in (None, {"Authorization": "Bearer nope"}, {"Authorization": "adm"}, wrong_basic):
            refused = get(app, path, headers)
            assert refused.status_code == 401
            assert refused.json()["error"]["code"] == "invalid_api_key"
            assert refused.headers["www-authenticate"] == 'Basic realm="kvhive dashboard", charset="UTF-8"'
        for headers in ({"Authorization": "Bearer adm"}, {"x-api-key": "adm"},
                        {"Authorization": "Basic " + base64.b64encode(b"x:adm").decode()}):
            assert get(app, path, headers).status_code == 200
    assert get(app, "/dashboard", {"Authorization": "Bearer adm"}).text.startswith("<!doctype html>")
    unknown = get(app, "/dashboard/data?window=60", {"Authorization": "Bearer adm"})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "window"


def test_no_dashboard_is_a_404_on_both_paths(tokenizer) -> None:
    app = gateway_app(tokenizer, DashboardAccess(enabled=False))
    assert get(app, "/dashboard").status_code == 404
    assert get(app, "/dashboard/data").status_code == 404


@pytest.mark.parametrize("argv,enabled,admin", [([], True, None), (["--no-dashboard", "--admin-key", "a"], False, "a")])
def test_gateway_flags(argv: list[str], enabled: bool, admin: str | None) -> None:
    from kvhive.cli import build_parser

    args = build_parser()[1]["gateway"].parse_args(["--replica", REPLICAS[0], *argv])
    assert (args.dashboard, args.admin_key) == (enabled, admin)
