"""A replica killed with SIGKILL behind the gateway (real processes): requests that got no byte of
an answer go to the other replica (once, counted in kvhive_gateway_retries_total), and a stream the
replica was sending ends with OpenAI's error event instead of a silent cut.

Two tiny replicas behind a gateway routing in turn (``--policy round_robin``), whose health checks
are slow to drop a replica (so requests meet the dead one before a health check does).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from support.cluster import Cluster, TinyReplica, restore, start_gateway, stop_gateway, tiny_replicas
from support.servers import SERVED_MODEL_NAME, wait_until

REPLICA, REASON = "x-kvhive-replica", "x-kvhive-route-reason"
# Long enough that the replica is still generating when the test kills it.
LONG = {"model": SERVED_MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 480, "temperature": 0,
        "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with tiny_replicas(2) as replicas:
        started = start_gateway(replicas, "--policy", "round_robin", "--health-interval", "1",
                                "--failures-to-drop", "5")
        try:
            yield started
        finally:
            stop_gateway(started)


@pytest.fixture()
def both_up(cluster: Cluster) -> Cluster:
    restore(cluster)
    return cluster


def retries(cluster: Cluster) -> float:
    return cluster.metric_sum("kvhive_gateway_retries_total")


def replica(cluster: Cluster, url: str) -> TinyReplica:
    return next(r for r in cluster.replicas if r.url == url)  # type: ignore[misc]


def in_flight_on(cluster: Cluster) -> str | None:
    for r in cluster.replicas:
        if cluster.metric_sum("kvhive_gateway_replica_inflight", {"replica": r.url}) > 0:
            return r.url
    return None


def test_requests_after_a_replica_is_killed_go_to_the_other(both_up: Cluster) -> None:
    cluster = both_up
    with cluster.client() as client:
        warm = [client.post("/v1/completions", json={**LONG, "max_tokens": 1}) for _ in range(2)]
        assert {r.headers[REPLICA] for r in warm} == {r.url for r in cluster.replicas}
        victim, survivor = cluster.replicas
        before = retries(cluster)
        victim.kill()
        after = [client.post("/v1/completions", json={**LONG, "max_tokens": 1}) for _ in range(6)]
    assert [r.status_code for r in after] == [200] * 6, [r.text for r in after]
    assert {r.headers[REPLICA] for r in after} == {survivor.url}
    # The first one sent to the dead replica was retried; the refused connection dropped it at once.
    assert [r.headers[REASON] for r in after].count("retry") == 1
    assert retries(cluster) == before + 1
    assert cluster.metric_sum("kvhive_gateway_retries_total", {"reason": "connect"}) >= 1
    assert cluster.replica_states()[victim.url] == "down"


def test_a_request_in_flight_on_a_killed_replica_is_answered_by_the_other(both_up: Cluster) -> None:
    cluster = both_up
    before = retries(cluster)
    result: dict[str, Any] = {}

    def post() -> None:
        with cluster.client() as client:
            result["response"] = client.post("/v1/completions", json=LONG)

    thread = threading.Thread(target=post)
    thread.start()
    holder: str | None = None

    def reached() -> bool:
        nonlocal holder
        holder = in_flight_on(cluster)
        return holder is not None

    wait_until(reached, 10, "the request to reach a replica")
    assert holder is not None
    victim = replica(cluster, holder)
    victim.kill()
    thread.join(60)
    response = result["response"]
    assert response.status_code == 200, response.text
    assert response.headers[REPLICA] != victim.url and response.headers[REASON] == "retry"
    assert response.json()["usage"]["completion_tokens"] == LONG["max_tokens"]
    assert retries(cluster) == before + 1


def read_events(response: httpx.Response, victim_after: int, kill: Any) -> list[str]:
    """The SSE data lines of ``response``; ``kill`` runs once ``victim_after`` events came."""
    lines: list[str] = []
    for line in response.iter_lines():
        if line.startswith("data: ") or line.startswith("event: "):
            lines.append(line)
            if len(lines) == victim_after:
                kill()
    return lines


def test_a_stream_cut_by_a_killed_replica_ends_with_an_error_event(both_up: Cluster) -> None:
    cluster = both_up
    cut_before = cluster.metric_sum("kvhive_gateway_stream_errors_total")
    with cluster.client() as client:
        with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response:
            assert response.status_code == 200
            victim = replica(cluster, response.headers[REPLICA])
            lines = read_events(response, 3, victim.kill)
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert (error["type"], error["code"]) == ("server_error", "bad_gateway")
    assert victim.url in error["message"]
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in lines[:-2]]
    assert 3 <= len(texts) < LONG["max_tokens"]                 # cut mid-way
    assert cluster.metric_sum("kvhive_gateway_stream_errors_total") == cut_before + 1
    assert cluster.metric_sum("kvhive_gateway_stream_errors_total", {"replica": victim.url}) >= 1
    wait_until(lambda: cluster.metric_sum("kvhive_gateway_replica_inflight") == 0, 10,
               "the gateway to release the request")


def test_a_cut_responses_stream_ends_with_an_error_event(both_up: Cluster) -> None:
    cluster = both_up
    body = {"model": SERVED_MODEL_NAME, "input": "Tell me a long story.", "max_output_tokens": 400,
            "temperature": 0, "stream": True}
    with cluster.client() as client:
        with client.stream("POST", "/v1/responses", json=body) as response:
            assert response.status_code == 200
            victim = replica(cluster, response.headers[REPLICA])
            lines = read_events(response, 12, victim.kill)
    assert lines[-2] == "event: error"
    error = json.loads(lines[-1].removeprefix("data: "))
    previous = json.loads(lines[-3].removeprefix("data: "))
    assert (error["type"], error["code"]) == ("error", "bad_gateway")
    assert error["sequence_number"] == previous["sequence_number"] + 1
    assert not any('"response.completed"' in line for line in lines)
