"""A session outlives its replica: with a shared Redis tier, the gateway sends the session's next
turn to another replica, which loads the session and its KV from Redis (real processes).

Two ``kvhive serve`` replicas on the default model share one ``redis-server`` (``--redis-url``);
the gateway routes by their KV events. The replica holding a session is killed; the next turn with
the session's ``x-session-id`` goes to the survivor and reports cached tokens.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from support.cluster import Cluster, default_cluster, long_prompt
from support.redis_server import RedisServer
from support.servers import SERVED_MODEL_NAME, wait_until


@pytest.fixture(scope="module")
def redis_cluster(module_redis_server: RedisServer) -> Iterator[Cluster]:
    with default_cluster("--redis-url", module_redis_server.url, print_replica_logs=True) as cluster:
        yield cluster


def cached_tokens(response: httpx.Response) -> int:
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_session_moves_to_another_replica_through_the_redis_tier(redis_cluster: Cluster) -> None:
    history = long_prompt(500, words=200)
    with redis_cluster.client() as client:
        created = client.post("/v1/context", json={"model": SERVED_MODEL_NAME, "prompt": history,
                                                   "max_tokens": 4, "temperature": 0})
        assert created.status_code == 200, created.text
        session = {"x-session-id": created.headers["x-session-id"]}
        holder = created.headers["x-kvhive-replica"]
        history += created.json()["choices"][0]["text"] + " And then?"
        turn = client.post("/v1/completions", headers=session, json={
            "model": SERVED_MODEL_NAME, "prompt": history, "max_tokens": 4, "temperature": 0})
        assert turn.status_code == 200, turn.text
        assert turn.headers["x-kvhive-replica"] == holder
        assert turn.headers["x-kvhive-route-reason"] == "session"
        assert cached_tokens(turn) > 0
        history += turn.json()["choices"][0]["text"] + " Go on."

        victim = next(r for r in redis_cluster.replicas if r.url == holder)
        survivor = next(r for r in redis_cluster.replicas if r.url != holder)
        victim.kill()
        wait_until(lambda: redis_cluster.replica_states()[victim.url] == "down", 10,
                   "the gateway to drop the session's replica")

        moved = client.post("/v1/completions", headers=session, json={
            "model": SERVED_MODEL_NAME, "prompt": history, "max_tokens": 4, "temperature": 0})
        assert moved.headers["x-kvhive-replica"] == survivor.url
        # The survivor never computed this history: what it finds cached came from the Redis tier.
        plain = client.post("/v1/completions", json={
            "model": SERVED_MODEL_NAME, "prompt": history, "max_tokens": 1, "temperature": 0})
        assert plain.status_code == 200 and plain.headers["x-kvhive-replica"] == survivor.url
        assert cached_tokens(plain) >= 16 * 10
        assert moved.status_code == 200, moved.text
        assert cached_tokens(moved) >= 16 * 10
        # The session now lives on the survivor, and its next turn stays there.
        again = client.post("/v1/completions", headers=session, json={
            "model": SERVED_MODEL_NAME, "prompt": history + moved.json()["choices"][0]["text"],
            "max_tokens": 1, "temperature": 0})
        assert again.status_code == 200 and again.headers["x-kvhive-replica"] == survivor.url
        assert again.headers["x-kvhive-route-reason"] == "session"
