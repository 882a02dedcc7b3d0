"""Gateways that share state and replicas that register themselves, as real processes.

Two ``kvhive serve`` replicas on the default model register in one redis-server (``--register``,
a 3 s TTL). Gateway 1 lists replica 1 (``--replica``) and discovers the other; gateway 2 only
discovers (``--discover``); both keep session affinity and the block index in the same Redis
(``--redis-url``). A session created through gateway 1 and continued through gateway 2 lands on its
holder, cached; so does a ``previous_response_id`` chain. With Redis hung (SIGSTOP), both gateways
answer every request and keep their replicas. A killed replica leaves both gateways' replica lists
within the documented bound (TTL + discovery interval); one stopped with SIGTERM deregisters. The
replicas start once for the module; the last two tests stop them.

The registry, affinity and index in process: tests/e2e/test_gateway_registry.py.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from support.cluster import (
    Cluster,
    ReplicaProcess,
    long_prompt,
    running_replicas,
    start_gateway,
    stop_gateway,
)
from support.redis_server import RedisServer
from support.servers import SERVED_MODEL_NAME, wait_until

TTL_S = 3.0                     # the replicas' --register-ttl
DISCOVER_S = 0.5                # the gateways' --discover-interval
BOUND_S = TTL_S + DISCOVER_S    # a replica whose heartbeat stops leaves within this (docs/deploy.md)


@dataclass
class Fleet:
    """Two registered replicas behind two gateways that share one Redis."""

    redis: RedisServer
    replicas: list[ReplicaProcess]
    first: Cluster              # lists replica 1, discovers replica 2
    second: Cluster             # discovers both

    def listed(self, gateway: Cluster) -> set[str]:
        """The replicas ``gateway`` lists on /health."""
        return set(gateway.replica_states())


@pytest.fixture(scope="module")
def fleet(module_redis_server: RedisServer) -> Iterator[Fleet]:
    url = module_redis_server.url
    replicas = [ReplicaProcess(extra_args=("--register", url, "--register-ttl", str(TTL_S))) for _ in range(2)]
    shared = ("--redis-url", url, "--discover", url, "--discover-interval", str(DISCOVER_S),
              "--health-interval", "0.3", "--failures-to-drop", "1")
    with running_replicas(replicas, print_logs=True):
        first = start_gateway(replicas[:1], *shared)
        try:
            second = start_gateway([], *shared)
        except BaseException:
            stop_gateway(first)
            raise
        fleet = Fleet(module_redis_server, replicas, first, second)
        try:
            urls = {r.url for r in replicas}
            for gateway in (first, second):
                wait_until(lambda g=gateway: fleet.listed(g) == urls
                           and set(g.replica_states().values()) == {"up"}, 30, "both replicas up")
            yield fleet
        finally:
            stop_gateway(first)
            stop_gateway(second)


def completion(client: httpx.Client, prompt: str, headers: dict[str, str] | None = None,
               path: str = "/v1/completions") -> httpx.Response:
    response = client.post(path, headers=headers or {}, json={
        "model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": 3, "temperature": 0})
    assert response.status_code == 200, response.text
    return response


def cached_tokens(response: httpx.Response) -> int:
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_session_continued_through_another_gateway_lands_on_its_holder_cached(fleet: Fleet) -> None:
    history = long_prompt(700, words=150)
    with fleet.first.client() as one, fleet.second.client() as two:
        created = completion(one, history, path="/v1/context")
        holder, session = created.headers["x-kvhive-replica"], {"x-session-id": created.headers["x-session-id"]}
        history += created.json()["choices"][0]["text"] + " And then?"
        turn = completion(two, history, session)
        assert (turn.headers["x-kvhive-replica"], turn.headers["x-kvhive-route-reason"]) == (holder, "session")
        assert cached_tokens(turn) > 0
        # And back through gateway 1, which learned nothing new itself.
        history += turn.json()["choices"][0]["text"] + " Go on."
        again = completion(one, history, session)
        assert (again.headers["x-kvhive-replica"], again.headers["x-kvhive-route-reason"]) == (holder, "session")
        assert cached_tokens(again) > cached_tokens(turn)


def test_a_response_chain_continued_through_another_gateway_lands_on_its_holder_cached(fleet: Fleet) -> None:
    with fleet.first.client() as one, fleet.second.client() as two:
        first = one.post("/v1/responses", json={"model": SERVED_MODEL_NAME, "input": long_prompt(701, words=150),
                                                "max_output_tokens": 3, "temperature": 0})
        assert first.status_code == 200, first.text
        holder = first.headers["x-kvhive-replica"]
        nxt = two.post("/v1/responses", json={"model": SERVED_MODEL_NAME, "input": "And then?",
                                              "previous_response_id": first.json()["id"],
                                              "max_output_tokens": 3, "temperature": 0})
        assert nxt.status_code == 200, nxt.text
        assert (nxt.headers["x-kvhive-replica"], nxt.headers["x-kvhive-route-reason"]) == (holder, "session")
        assert nxt.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0


def test_with_redis_hung_both_gateways_answer_every_request_and_keep_their_replicas(fleet: Fleet) -> None:
    history = long_prompt(702, words=120)
    urls = {r.url for r in fleet.replicas}
    with fleet.first.client() as one, fleet.second.client() as two:
        created = completion(one, history, path="/v1/context")
        holder, session = created.headers["x-kvhive-replica"], {"x-session-id": created.headers["x-session-id"]}
        completion(two, history + " Again.", session)            # gateway 2 learns the holder too
        os.kill(fleet.redis.process.pid, signal.SIGSTOP)
        try:
            # Longer than the registration TTL: nobody beats, nothing is read, nothing is dropped.
            for i in range(4):
                for client in (one, two):
                    turn = completion(client, history + f" Turn {i}.", session)
                    assert turn.headers["x-kvhive-replica"] == holder          # from the gateway's own map
                    completion(client, long_prompt(710 + i, words=30))          # by load
                    assert fleet.listed(fleet.first) == fleet.listed(fleet.second) == urls
        finally:
            os.kill(fleet.redis.process.pid, signal.SIGCONT)
    for gateway in (fleet.first, fleet.second):
        assert fleet.listed(gateway) == urls
        assert gateway.metric("kvhive_gateway_shared_state_failures_total") > 0
        wait_until(lambda g=gateway: g.metric("kvhive_gateway_shared_state_up") == 1.0, 30,
                   "the gateway to reach Redis again")


def test_a_killed_replica_leaves_both_gateways_within_the_bound(fleet: Fleet) -> None:
    victim, survivor = fleet.replicas[1], fleet.replicas[0]
    # Gateway 2 knows the victim only from the registry, follows its KV events (the endpoints it
    # registered) into the shared index, and routes a prompt the victim holds to it.
    prompt = long_prompt(720, words=150)
    held = fleet.redis.admin().scard(f"kvhive:idx:r:{victim.url}")
    with httpx.Client(base_url=victim.url, timeout=60) as direct:
        completion(direct, prompt)
    wait_until(lambda: fleet.redis.admin().scard(f"kvhive:idx:r:{victim.url}") > held, 30,
               "the victim's blocks in the shared index")
    with fleet.second.client() as two:
        routed = completion(two, prompt)
    assert (routed.headers["x-kvhive-replica"], routed.headers["x-kvhive-route-reason"]) == (victim.url, "kv")
    assert cached_tokens(routed) > 0
    victim.kill()
    for gateway in (fleet.first, fleet.second):
        wait_until(lambda g=gateway: victim.url not in fleet.listed(g), 3 * BOUND_S,
                   f"the gateway to remove {victim.url}")
        assert fleet.listed(gateway) == {survivor.url}
        with gateway.client() as client:
            assert completion(client, long_prompt(730, words=20)).headers["x-kvhive-replica"] == survivor.url


def test_a_replica_stopped_cleanly_deregisters(fleet: Fleet) -> None:
    replica = fleet.replicas[0]                 # static on gateway 1, discovered on gateway 2
    assert replica.process is not None
    replica.process.terminate()                 # SIGTERM: the graceful shutdown
    assert replica.process.wait(60) == 0
    record = json.loads(fleet.redis.admin().get(f"kvhive:replica:{replica.url}"))
    assert record["leaving"] is True            # marked at shutdown, not left to expire
    wait_until(lambda: fleet.listed(fleet.second) == set(), 3 * BOUND_S, "gateway 2 to remove it")
    assert fleet.listed(fleet.first) == {replica.url}       # a --replica stays listed (as down)
