"""What gateways keep in Redis, in process against a real redis-server: the replica registry
(``kvhive serve --register`` writes it, ``kvhive gateway --discover`` reads it), session affinity
shared by gateways, and the block index behind the gateway's guarded link; with Redis flushed,
hung (SIGSTOP) or gone, the gateway keeps its replicas and routes by its own map and by load.

The whole processes (two gateways, registered replicas): tests/e2e/test_gateway_shared_state.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest
from support.redis_server import RedisServer
from support.servers import wait_until

from kvhive.core.replica_registry import MEMBERS_KEY, RegistrationConfig, ReplicaRecord, record_key
from kvhive.gateway.discovery import RegistryReader, ReplicaDiscovery, registered_specs
from kvhive.gateway.gateway_config import ReplicaSpec
from kvhive.gateway.replicas import Replica, ReplicaSet
from kvhive.routing.affinity import SharedAffinity
from kvhive.routing.index import InMemoryIndex
from kvhive.routing.redis_link import GuardedIndex, RedisLink, SharedStateUnavailable
from kvhive.server.registration import ReplicaHeartbeat

TTL_S = 1.5           # the registration TTL of these tests: a heartbeat every 0.5 s
INTERVAL_S = 0.2      # the discovery poll of these tests


@pytest.fixture()
def redis(module_redis_server: RedisServer) -> Iterator[RedisServer]:
    module_redis_server.admin().flushall()
    yield module_redis_server


def heartbeat(redis: RedisServer, port: int, fingerprint: str = "fp") -> ReplicaHeartbeat:
    config = RegistrationConfig(redis.url, f"http://127.0.0.1:{port}", TTL_S)
    return ReplicaHeartbeat(config, config.record("tcp://*:5557", "tcp://*:5558", fingerprint))


class Discovering:
    """A ReplicaSet and the discovery that feeds it, polled by the test."""

    def __init__(self, url: str, fingerprint: str = "fp", static: tuple[str, ...] = ()) -> None:
        # Short back-offs: every poll after an outage reaches Redis as soon as it answers.
        self.link = RedisLink(url, timeout_s=0.3, base_backoff_s=0.05, max_backoff_s=0.1)
        self.client = httpx.AsyncClient()
        self.index = InMemoryIndex()
        self.replica_set = ReplicaSet([Replica(ReplicaSpec(u)) for u in static], self.index, self.client)
        # Replicas without an event stream: the registry, not the events, is under test.
        self.discovery = ReplicaDiscovery(RegistryReader(self.link), self.replica_set,
                                          lambda spec: Replica(ReplicaSpec(spec.url)), INTERVAL_S,
                                          fingerprint, static)

    def names(self) -> list[str]:
        """Poll the registry once; the replicas the set holds."""
        asyncio.run(self.discovery.poll())
        return [r.name for r in self.replica_set.replicas]

    def close(self) -> None:
        asyncio.run(self.client.aclose())
        self.link.close()


@pytest.fixture()
def gateway_side(redis: RedisServer) -> Iterator[Discovering]:
    side = Discovering(redis.url, static=("http://127.0.0.1:1",))
    yield side
    side.close()


def test_a_heartbeat_registers_the_replica_with_connectable_event_sockets(redis: RedisServer) -> None:
    beat = heartbeat(redis, 9001)
    beat.start()
    try:
        admin = redis.admin()
        assert admin.smembers(MEMBERS_KEY) == {b"http://127.0.0.1:9001"}
        assert 0 < admin.pttl(record_key("http://127.0.0.1:9001")) <= TTL_S * 1000
        [entry] = RegistryReader(RedisLink(redis.url)).read()
        assert entry.record == ReplicaRecord("http://127.0.0.1:9001", "tcp://127.0.0.1:5557",
                                             "tcp://127.0.0.1:5558", "fp", TTL_S)
        assert 0 < entry.expires_in_s <= TTL_S
        assert registered_specs(RedisLink(redis.url), wait_s=0) == (ReplicaSpec("http://127.0.0.1:9001"),)
    finally:
        beat.stop()
    [entry] = RegistryReader(RedisLink(redis.url)).read()
    assert entry.record.leaving


def test_discovery_adds_registered_replicas_beside_static_ones_and_removes_deregistered(
        redis: RedisServer, gateway_side: Discovering) -> None:
    beat = heartbeat(redis, 9002)
    beat.start()
    assert gateway_side.names() == ["http://127.0.0.1:1", "http://127.0.0.1:9002"]
    assert gateway_side.names() == ["http://127.0.0.1:1", "http://127.0.0.1:9002"]     # added once
    beat.stop(deregister=True)
    assert gateway_side.names() == ["http://127.0.0.1:1"]                              # at the next poll


def test_a_replica_whose_heartbeat_stops_is_removed_within_ttl_plus_one_poll(
        redis: RedisServer, gateway_side: Discovering) -> None:
    beat = heartbeat(redis, 9003)
    beat.start()
    assert "http://127.0.0.1:9003" in gateway_side.names()
    beat.stop(deregister=False)                    # as a killed process: no goodbye
    assert "http://127.0.0.1:9003" in gateway_side.names()         # its record has not expired yet
    wait_until(lambda: "http://127.0.0.1:9003" not in gateway_side.names(), 3 * (TTL_S + INTERVAL_S),
               "the gateway to remove the replica")
    assert not redis.admin().exists(record_key("http://127.0.0.1:9003"))   # removed once it expired
    assert redis.admin().smembers(MEMBERS_KEY) == set()            # and the gateway removed the member


def test_a_flushed_registry_removes_no_live_replica(redis: RedisServer, gateway_side: Discovering) -> None:
    beat = heartbeat(redis, 9004)
    beat.start()
    try:
        assert "http://127.0.0.1:9004" in gateway_side.names()
        beats = beat.num_beats
        redis.admin().flushall()
        # Polled until well past a TTL: the record is back after the next beat, and the replica
        # never left the gateway's set meanwhile.
        deadline = time.monotonic() + 2 * TTL_S
        while time.monotonic() < deadline:
            assert "http://127.0.0.1:9004" in gateway_side.names()
            time.sleep(INTERVAL_S)
        assert beat.num_beats > beats
        assert redis.admin().exists(record_key("http://127.0.0.1:9004"))
    finally:
        beat.stop()


def test_a_replica_of_another_model_and_a_broken_record_are_not_routed_to(
        redis: RedisServer, gateway_side: Discovering) -> None:
    other = heartbeat(redis, 9005, fingerprint="another-model")
    other.start()
    admin = redis.admin()
    admin.sadd(MEMBERS_KEY, "http://127.0.0.1:9006", "http://127.0.0.1:9007")
    admin.set(record_key("http://127.0.0.1:9006"), b"not json", ex=60)
    admin.set(record_key("http://127.0.0.1:9007"), b'{"url": "ftp://x", "ttl_s": 5}', ex=60)
    try:
        assert gateway_side.names() == ["http://127.0.0.1:1"]
    finally:
        other.stop()


def test_while_redis_is_hung_or_gone_the_gateway_keeps_its_replicas(redis_server: RedisServer) -> None:
    beat = heartbeat(redis_server, 9008)
    beat.start()
    side = Discovering(redis_server.url)
    try:
        assert side.names() == ["http://127.0.0.1:9008"]
        os.kill(redis_server.process.pid, signal.SIGSTOP)          # hung: connections open, no answers
        try:
            deadline = time.monotonic() + 2 * TTL_S
            while time.monotonic() < deadline:
                assert side.names() == ["http://127.0.0.1:9008"]
                time.sleep(INTERVAL_S)
        finally:
            os.kill(redis_server.process.pid, signal.SIGCONT)
        redis_server.stop()                                       # gone for more than a TTL
        deadline = time.monotonic() + 1.5 * TTL_S
        while time.monotonic() < deadline:
            assert side.names() == ["http://127.0.0.1:9008"]
            time.sleep(INTERVAL_S)
        assert not side.link.reachable
        # Back empty: the replica, still beating, gets a TTL to write its record again.
        redis_server.start()
        deadline = time.monotonic() + 2 * TTL_S
        while time.monotonic() < deadline:
            assert side.names() == ["http://127.0.0.1:9008"]
            time.sleep(INTERVAL_S)
        assert side.link.reachable and redis_server.admin().exists(record_key("http://127.0.0.1:9008"))
    finally:
        beat.stop(deregister=False)
        side.close()


def test_session_affinity_is_shared_by_gateways_and_lives_as_long_as_its_ttl(redis: RedisServer) -> None:
    first = SharedAffinity(RedisLink(redis.url), ttl_s=600)
    second = SharedAffinity(RedisLink(redis.url), ttl_s=600)
    first.remember("owner-a", "sess-1", "http://r1")
    assert second.get("owner-a", "sess-1") == "http://r1"
    assert second.get("owner-b", "sess-1") is None                 # another key's id is unknown
    [key] = redis.admin().keys("kvhive:affinity:*")
    assert 590 < redis.admin().ttl(key) <= 600
    second.remember("owner-a", "sess-1", "http://r2")               # the session moved
    assert first.get("owner-a", "sess-1") == "http://r2"            # Redis wins over first's own map
    second.forget("owner-a", "sess-1")
    assert redis.admin().keys("kvhive:affinity:*") == []
    long_id = "x" * 100_000                                         # ids of any length: a bounded key
    first.remember("owner-a", long_id, "http://r1")
    assert all(len(k) < 64 for k in redis.admin().keys("kvhive:affinity:*"))
    assert second.get("owner-a", long_id) == "http://r1"


def test_without_redis_affinity_answers_from_the_local_map_and_the_index_finds_nothing(
        redis_server: RedisServer) -> None:
    link = RedisLink(redis_server.url, timeout_s=0.2, base_backoff_s=30.0)
    affinity = SharedAffinity(link, ttl_s=600)
    index = GuardedIndex(link)
    affinity.remember("owner", "sess", "http://r1")
    index.add([b"k" * 16], "http://r1", "GPU")
    assert index.lookup([b"k" * 16]) == [{"http://r1": "GPU"}]
    os.kill(redis_server.process.pid, signal.SIGSTOP)
    try:
        assert affinity.get("owner", "sess") == "http://r1"        # the first call times out...
        assert not link.reachable
        affinity.remember("owner", "other", "http://r2")           # ...then calls fail fast
        assert affinity.get("owner", "other") == "http://r2"
        assert index.lookup([b"k" * 16]) == []                     # routed by load
        index.add([b"j" * 16], "http://r2", "GPU")
        assert index.num_dropped == 1
        with pytest.raises(SharedStateUnavailable):
            link.call(lambda: link.client.ping())
        assert link.num_failures == 1                              # one timeout, not one per call
    finally:
        os.kill(redis_server.process.pid, signal.SIGCONT)
