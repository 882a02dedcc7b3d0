"""Every PromQL expression of the Grafana dashboards in ``examples/grafana/`` reads samples that real
processes export: a ``kvhive serve`` with every family switched on (CPU and disk tiers, KV events,
``--kv-role prefill`` for the KV-transfer families, ``--speculative-config`` for the drafting ones) and a ``kvhive gateway`` in front of it, each
scraped after requests went through. The replica's dashboard is checked against the replica's
scrape, the gateway's against the gateway's; a name, a label or a counter read without a range that
the scrape does not back is reported with its panel. The unit half (dashboard shape, the PromQL
scan, a made-up name caught) is ``tests/unit/test_grafana_promql.py``.

Families a dashboard reads that need what this module does not start (Redis) share their names
with the CPU and disk tiers here (label ``tier``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import httpx
import pytest
from support.cluster import Cluster, start_gateway, stop_gateway
from support.kvhive_serve import ServeProcess
from support.promql import ExportedSample, exported_samples, load_dashboard, query_problems
from support.servers import SERVED_MODEL_NAME, free_port


class EventedReplica(NamedTuple):
    """The server as a gateway replica: its URL and its ``--replica`` spec with the KV-event socket."""

    url: str
    spec: str


class Scrapes(NamedTuple):
    """The samples each process exported once requests went through."""

    replica: dict[str, ExportedSample]
    gateway: dict[str, ExportedSample]


@pytest.fixture(scope="module")
def scrapes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scrapes]:
    events_port = free_port()
    server = ServeProcess("--max-model-len", "1024", "--kv-cache-gb", "0.25", "--cpu-offload-gb", "0.05",
                          "--disk-cache-dir", str(tmp_path_factory.mktemp("disk-tier")), "--kv-role", "prefill",
                          "--kv-events", f"tcp://127.0.0.1:{events_port}",
                          "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
    cluster: Cluster | None = None
    try:
        spec = f"{server.url},events=tcp://127.0.0.1:{events_port},kind=kvhive"
        cluster = start_gateway([EventedReplica(server.url, spec)])
        send_requests(server.url, cluster.gateway_url)
        yield Scrapes(scrape(server.url), scrape(cluster.gateway_url))
    finally:
        if cluster is not None:
            stop_gateway(cluster)
        server.stop()


def send_requests(replica_url: str, gateway_url: str) -> None:
    """A completion and a session (made, then a turn) through the gateway, a stored response on the replica."""
    body = {"model": SERVED_MODEL_NAME, "max_tokens": 2, "temperature": 0}
    chat = {**body, "messages": [{"role": "user", "content": "Hi."}]}
    with httpx.Client(timeout=120) as client:
        r = client.post(f"{gateway_url}/v1/completions", json={**body, "prompt": "The grafana test asks once."})
        assert r.status_code == 200, r.text
        r = client.post(f"{gateway_url}/v1/context", json=chat, headers={"x-session-ttl": "600"})
        assert r.status_code == 200, r.text
        r = client.post(f"{gateway_url}/v1/chat/completions", json=chat,
                        headers={"x-session-id": r.headers["x-session-id"]})
        assert r.status_code == 200, r.text
        r = client.post(f"{replica_url}/v1/responses", json={"model": SERVED_MODEL_NAME, "input": "Say hi.",
                                                            "max_output_tokens": 2})
        assert r.status_code == 200, r.text


def scrape(url: str) -> dict[str, ExportedSample]:
    """The sample names, types and labels of one ``GET /metrics``."""
    r = httpx.get(f"{url}/metrics", timeout=10)
    assert r.status_code == 200
    return exported_samples(r.text)


def test_the_replica_dashboard_reads_what_kvhive_serve_exports(scrapes: Scrapes) -> None:
    assert "kvhive_kv_transfer_seconds_bucket" in scrapes.replica      # the module's flags took effect
    problems = query_problems(load_dashboard("kvhive-replica.json"), scrapes.replica)
    assert problems == [], "\n".join(problems)


def test_the_gateway_dashboard_reads_what_kvhive_gateway_exports(scrapes: Scrapes) -> None:
    assert "kvhive_gateway_kv_event_events_total" in scrapes.gateway
    problems = query_problems(load_dashboard("kvhive-gateway.json"), scrapes.gateway)
    assert problems == [], "\n".join(problems)


def test_a_dashboard_checked_against_the_other_process_fails(scrapes: Scrapes) -> None:
    problems = query_problems(load_dashboard("kvhive-gateway.json"), scrapes.replica)
    assert "Replica health: kvhive_gateway_replica_up is not exported" in problems
