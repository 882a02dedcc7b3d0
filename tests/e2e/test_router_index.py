"""The global KV block index: in-memory LRU and Redis backends behave the same (real redis-server);
the in-memory one alone: tests/unit/test_router_index_memory.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.redis_server import RedisServer

from kvhive.routing.index import InMemoryIndex, KVBlockIndex, RedisIndex


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def keys(*ids: int) -> list[bytes]:
    return [key(i) for i in ids]


@pytest.fixture(scope="module")
def redis_url(module_redis_server: RedisServer) -> str:
    return module_redis_server.url


@pytest.fixture(params=["memory", "redis"])
def index(request: pytest.FixtureRequest) -> Iterator[KVBlockIndex]:
    if request.param == "memory":
        yield InMemoryIndex(max_keys=1000)
        return
    url = request.getfixturevalue("redis_url")
    import redis

    redis.Redis.from_url(url).flushdb()
    backend = RedisIndex(url)
    yield backend
    backend.close()


def test_lookup_reports_holders_and_stops_at_first_key_nobody_holds(index: KVBlockIndex) -> None:
    index.add(keys(0, 1, 2), "a", "GPU")
    index.add(keys(0, 1), "b", "CPU")
    index.add(keys(4), "b", "GPU")           # after a hole at key 3: never reached
    assert index.lookup(keys(0, 1, 2, 3, 4)) == [{"a": "GPU", "b": "CPU"}, {"a": "GPU", "b": "CPU"},
                                                  {"a": "GPU"}]
    assert index.lookup(keys(9, 0)) == []
    assert index.lookup([]) == []


def test_fastest_medium_wins_and_tiers_are_tracked_separately(index: KVBlockIndex) -> None:
    index.add(keys(0), "a", "DISK")
    index.add(keys(0), "a", "CPU")
    assert index.lookup(keys(0)) == [{"a": "CPU"}]
    index.add(keys(0), "a", "GPU")
    assert index.lookup(keys(0)) == [{"a": "GPU"}]
    index.remove(keys(0), "a", "GPU")        # the CPU and disk copies stay
    assert index.lookup(keys(0)) == [{"a": "CPU"}]
    index.remove(keys(0), "a", "CPU")
    index.remove(keys(0), "a", "DISK")
    assert index.lookup(keys(0)) == []
    index.add(keys(1), "a", None)            # vLLM's older device pool: no medium
    assert index.lookup(keys(1)) == [{"a": "GPU"}]


def test_remove_touches_only_that_replica(index: KVBlockIndex) -> None:
    index.add(keys(0, 1), "a", "GPU")
    index.add(keys(0, 1), "b", "GPU")
    index.remove(keys(0), "a", "GPU")
    index.remove(keys(5), "a", "GPU")        # unknown keys and replicas are ignored
    index.remove(keys(0), "nobody", "GPU")
    assert index.lookup(keys(0, 1)) == [{"b": "GPU"}, {"a": "GPU", "b": "GPU"}]


def test_clear_replica(index: KVBlockIndex) -> None:
    index.add(keys(*range(50)), "a", "GPU")
    index.add(keys(0, 1), "b", "CPU")
    index.clear_replica("a")
    assert index.lookup(keys(0, 1, 2)) == [{"b": "CPU"}, {"b": "CPU"}]
    index.clear_replica("a")                 # twice, and unknown: no error
    index.clear_replica("never-seen")
    index.add(keys(2), "a", "GPU")           # the replica can come back
    assert index.lookup(keys(2)) == [{"a": "GPU"}]


def test_redis_index_shared_by_two_gateways(redis_url: str) -> None:
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    first, second = RedisIndex(redis_url), RedisIndex(redis_url)
    first.add(keys(0, 1), "a", "GPU")
    second.add(keys(0, 1), "a", "GPU")       # the same event ingested by both: idempotent
    second.add(keys(0), "b", "DISK")
    assert first.lookup(keys(0, 1)) == [{"a": "GPU", "b": "DISK"}, {"a": "GPU"}]
    first.clear_replica("a")
    assert second.lookup(keys(0, 1)) == [{"b": "DISK"}]
    first.close()
    second.close()


def test_redis_lookup_is_one_round_trip(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import redis

    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    index = RedisIndex(redis_url, client=client)
    index.add(keys(*range(64)), "http://a:1", "GPU")
    index.add(keys(*range(8)), "http://b:1", "CPU")
    assert index.lookup(keys(0)) == [{"http://a:1": "GPU", "http://b:1": "CPU"}]   # the script is loaded
    sent: list[str] = []
    real_execute = client.execute_command

    def spy(*args, **kwargs):
        sent.append(str(args[0]))
        return real_execute(*args, **kwargs)

    monkeypatch.setattr(client, "execute_command", spy)
    monkeypatch.setattr(client, "pipeline", lambda *a, **k: pytest.fail("lookup must not pipeline"))
    found = index.lookup(keys(*range(64), 999, 5))
    assert len(found) == 64 and found[7] == {"http://a:1": "GPU", "http://b:1": "CPU"}
    assert found[8] == {"http://a:1": "GPU"}
    assert sent == ["EVALSHA"]
    assert index.lookup(keys(999)) == [] and index.lookup([]) == []


def test_cache_keys_are_shared_by_gateways_apart_from_sessions(redis_url: str) -> None:
    from kvhive.gateway.gateway_config import GatewayConfig, ReplicaSpec
    from kvhive.gateway.wiring import build_affinity
    from kvhive.routing.redis_link import RedisLink

    config = GatewayConfig((ReplicaSpec("http://a:1"),), redis_url=redis_url)
    links = [RedisLink(redis_url), RedisLink(redis_url)]
    first, second = (build_affinity(config, link, "kvhive:cachekey:") for link in links)
    sessions = build_affinity(config, links[0])
    first.remember("owner-a", "agent-7", "http://a:1")
    assert second.get("owner-a", "agent-7") == "http://a:1"      # learned through another gateway
    assert second.get("owner-b", "agent-7") is None and sessions.get("owner-a", "agent-7") is None
    for link in links:
        link.close()
