"""Sick replicas behind the gateway (real processes): one healthy tiny replica and one whose /health
stays 200 while its requests fail (``serve_faulty --fault-mode``: 500s, garbage, or no answer at
all). After --outlier-consecutive-failures failures in a row the sick one is ejected, so every
later request goes to the healthy one and succeeds; after its ejection time it is probed again,
ejected for longer while it still fails, and routed to again once it answers. A replica whose
events endpoint nobody publishes on is reported silent, once, in the log and in /health.

Each test starts its own gateway (round robin, so the sick replica is asked every other request)
with short ejection times; the replicas live for the whole module.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from support.cluster import Cluster, TinyReplica, running_replicas, start_gateway, stop_gateway
from support.servers import SERVED_MODEL_NAME, free_port, wait_until
from support.sick_replica import SickReplica

REPLICA, REASON = "x-kvhive-replica", "x-kvhive-route-reason"
ASK = {"model": SERVED_MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}


@dataclass
class Pair:
    healthy: TinyReplica
    sick: SickReplica


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    with running_replicas([TinyReplica(), SickReplica()]) as (healthy, sick):
        yield Pair(healthy, sick)


@pytest.fixture()
def gateway_for(pair: Pair) -> Iterator:
    """Starts a gateway in front of both replicas with the given flags; stops it and makes the sick
    replica well again afterwards."""
    started: list[Cluster] = []

    def start(*flags: str) -> Cluster:
        cluster = start_gateway([pair.healthy, pair.sick], "--policy", "round_robin", "--health-interval",
                                "0.5", *flags)
        started.append(cluster)
        return cluster

    yield start
    for cluster in started:
        stop_gateway(cluster)
    pair.sick.set_mode("none")


def details(cluster: Cluster, url: str) -> dict:
    return httpx.get(f"{cluster.gateway_url}/health", timeout=10).json()["details"][url]


def ask(cluster: Cluster, n: int, **extra: object) -> list[httpx.Response]:
    with cluster.client() as client:
        return [client.post("/v1/completions", json={**ASK, **extra}) for _ in range(n)]


def test_a_replica_answering_500_is_ejected_probed_ejected_for_longer_then_back(pair: Pair, gateway_for) -> None:
    cluster = gateway_for("--outlier-consecutive-failures", "3", "--outlier-base-ejection-s", "3",
                          "--outlier-max-ejection-s", "20")
    sick, healthy = pair.sick.url, pair.healthy.url
    pair.sick.set_mode("500")
    answers = ask(cluster, 8)
    # Every request succeeds: each one the sick replica failed went to the healthy one instead.
    assert [r.status_code for r in answers] == [200] * 8, [r.text for r in answers]
    assert {r.headers[REPLICA] for r in answers} == {healthy}
    assert [r.headers[REASON] for r in answers].count("retry") == 3
    state = details(cluster, sick)
    assert state["routing"] == "ejected" and state["ejections"] == 1 and state["health"] == "up"
    assert state["ejected_for_s"] > 0 and state["ejected_until"].endswith("+00:00")
    assert cluster.metric("kvhive_gateway_upstream_failures_total", {"replica": sick, "kind": "5xx"}) == 3
    assert cluster.metric("kvhive_gateway_outlier_ejections_total", {"replica": sick}) == 1
    assert cluster.metric("kvhive_gateway_replica_ejected", {"replica": sick}) == 1
    assert cluster.metric("kvhive_gateway_replica_ejected", {"replica": healthy}) == 0
    assert cluster.metric_sum("kvhive_gateway_retries_total", {"reason": "5xx"}) == 3

    # Its ejection over, it is asked again; still failing, it is ejected at once, for longer.
    wait_until(lambda: details(cluster, sick)["routing"] == "probation", 30, "the ejection to end")
    probe = ask(cluster, 2)
    assert [r.status_code for r in probe] == [200, 200] and {r.headers[REPLICA] for r in probe} == {healthy}
    assert [r.headers[REASON] for r in probe].count("retry") == 1
    state = details(cluster, sick)
    assert state["routing"] == "ejected" and state["ejections"] == 2
    assert state["ejected_for_s"] > 3                   # base x 2
    assert cluster.metric("kvhive_gateway_outlier_ejections_total", {"replica": sick}) == 2

    # Well again: after its ejection the first request it answers returns it in full.
    pair.sick.set_mode("none")
    wait_until(lambda: details(cluster, sick)["routing"] == "probation", 30, "the second ejection to end")
    back = ask(cluster, 4)
    assert [r.status_code for r in back] == [200] * 4
    assert {r.headers[REPLICA] for r in back} == {healthy, sick}
    assert "retry" not in {r.headers[REASON] for r in back}
    state = details(cluster, sick)
    assert state["routing"] == "ok" and state["consecutive_failures"] == 0 and "ejected_until" not in state
    assert cluster.metric("kvhive_gateway_replica_ejected", {"replica": sick}) == 0


def test_a_replica_answering_garbage_is_ejected_and_its_requests_answered_elsewhere(pair: Pair,
                                                                                   gateway_for) -> None:
    cluster = gateway_for("--outlier-consecutive-failures", "2", "--outlier-base-ejection-s", "60")
    sick, healthy = pair.sick.url, pair.healthy.url
    pair.sick.set_mode("garbage")
    answers = ask(cluster, 4) + ask(cluster, 4, stream=True)
    assert [r.status_code for r in answers] == [200] * 8, [r.text for r in answers]
    assert {r.headers[REPLICA] for r in answers} == {healthy}
    assert [r.headers[REASON] for r in answers].count("retry") == 2
    assert all(r.json()["choices"] for r in answers[:4])
    assert all(r.text.rstrip().endswith("data: [DONE]") for r in answers[4:])
    assert cluster.metric("kvhive_gateway_upstream_failures_total", {"replica": sick, "kind": "malformed"}) == 2
    assert cluster.metric_sum("kvhive_gateway_retries_total", {"reason": "malformed"}) == 2
    assert cluster.metric("kvhive_gateway_outlier_ejections_total", {"replica": sick}) == 1
    assert details(cluster, sick)["routing"] == "ejected"


def test_a_replica_that_never_answers_is_cut_by_the_request_timeout_and_ejected(pair: Pair, gateway_for) -> None:
    cluster = gateway_for("--request-timeout", "2", "--connect-timeout", "2",
                          "--outlier-consecutive-failures", "2", "--outlier-base-ejection-s", "60")
    sick, healthy = pair.sick.url, pair.healthy.url
    pair.sick.set_mode("hang")
    answers = ask(cluster, 4, stream=True) + ask(cluster, 4)
    timed_out = [r for r in answers if r.status_code == 504]
    # A timed-out request is not sent again (the replica may still be working on it): its 504 says so.
    assert len(timed_out) == 2 and {r.headers[REPLICA] for r in timed_out} == {sick}
    assert {r.json()["error"]["code"] for r in timed_out} == {"gateway_timeout"}
    rest = answers[answers.index(timed_out[-1]) + 1:]
    assert rest and [r.status_code for r in rest] == [200] * len(rest)
    assert {r.headers[REPLICA] for r in rest} == {healthy}
    assert cluster.metric("kvhive_gateway_upstream_timeouts_total", {"replica": sick}) == 2
    assert cluster.metric("kvhive_gateway_upstream_failures_total", {"replica": sick, "kind": "timeout"}) == 2
    assert cluster.metric("kvhive_gateway_outlier_ejections_total", {"replica": sick}) == 1
    assert details(cluster, sick)["routing"] == "ejected"


@dataclass
class SilentEvents:
    """A replica given to the gateway with an events endpoint nobody publishes on."""

    replica: TinyReplica
    endpoint: str

    @property
    def url(self) -> str:
        return self.replica.url

    @property
    def spec(self) -> str:
        return f"{self.replica.url},events={self.endpoint}"


def test_a_replica_whose_events_never_arrive_is_reported_silent_once(pair: Pair) -> None:
    replica = SilentEvents(pair.healthy, f"tcp://127.0.0.1:{free_port()}")
    cluster = start_gateway([replica], "--events-silent-after", "1", "--health-interval", "0.3")
    try:
        assert details(cluster, replica.url)["events"] == {"endpoint": replica.endpoint, "state": "waiting"}
        assert [r.status_code for r in ask(cluster, 1)] == [200]
        wait_until(lambda: details(cluster, replica.url)["events"]["state"] == "silent", 30,
                   "the gateway to report the replica's events silent")
        assert [r.status_code for r in ask(cluster, 2)] == [200, 200]      # routed by load meanwhile
        wait_until(lambda: cluster.metric("kvhive_gateway_replica_up", {"replica": replica.url}) == 1, 5, "up")
        with open(cluster.gateway_log) as log:
            warnings = [line for line in log if "no KV event arrived" in line]
        assert len(warnings) == 1, warnings
        assert replica.url in warnings[0] and replica.endpoint in warnings[0]
        assert "falls back to load" in warnings[0]
    finally:
        stop_gateway(cluster)
