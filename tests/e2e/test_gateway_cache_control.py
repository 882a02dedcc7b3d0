"""The gateway in front of 2 real tiny replicas, by HTTP: a ``prompt_cache_key`` keeps its
replica, one over the bound is refused before any replica sees it, and a session fork goes to its
parent's replica, where the child's turns follow it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.cluster import Cluster, start_gateway, stop_gateway, tiny_replicas
from support.servers import SERVED_MODEL_NAME


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with tiny_replicas(2) as replicas:
        started = start_gateway(replicas, "--health-interval", "0.3")
        try:
            yield started
        finally:
            stop_gateway(started)


def chat(content: str, **extra: object) -> dict[str, object]:
    return {"model": SERVED_MODEL_NAME, "messages": [{"role": "user", "content": content}],
            "max_tokens": 2, "temperature": 0, **extra}


def test_a_cache_key_keeps_its_replica_and_an_oversized_one_is_refused(cluster: Cluster) -> None:
    with cluster.client() as client:
        answers = [client.post("/v1/chat/completions", json=chat(f"Question {i}?", prompt_cache_key="agent-1"))
                   for i in range(4)]
        assert {a.status_code for a in answers} == {200}, answers[0].text
        assert len({a.headers["x-kvhive-replica"] for a in answers}) == 1
        assert [a.headers["x-kvhive-route-reason"] for a in answers[1:]] == ["cache_key"] * 3
        refused = client.post("/v1/chat/completions", json=chat("Hi", prompt_cache_key="k" * 2000))
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_cache_key"
        assert "x-kvhive-replica" not in refused.headers
    assert cluster.metric("kvhive_gateway_cache_keys") == 1


def test_a_fork_goes_to_its_parents_replica_and_its_child_stays_there(cluster: Cluster) -> None:
    with cluster.client() as client:
        created = client.post("/v1/context", json={"model": SERVED_MODEL_NAME, "prompt": "Once upon a time",
                                                   "max_tokens": 2, "temperature": 0})
        assert created.status_code == 200, created.text
        parent, holder = created.headers["x-session-id"], created.headers["x-kvhive-replica"]
        for _ in range(3):
            fork = client.post(f"/v1/context/{parent}/fork", json={})
            assert fork.status_code == 200, fork.text
            child = fork.headers["x-session-id"]
            assert child != parent and fork.headers["x-kvhive-replica"] == holder
            turn = client.post("/v1/completions", headers={"x-session-id": child}, json={
                "model": SERVED_MODEL_NAME, "prompt": "Once upon a time there", "max_tokens": 2, "temperature": 0})
            assert turn.status_code == 200, turn.text
            assert (turn.headers["x-kvhive-replica"], turn.headers["x-kvhive-route-reason"]) == (holder, "session")
