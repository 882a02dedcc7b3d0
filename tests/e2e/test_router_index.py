"""The global KV block index: in-memory LRU and Redis backends behave the same (real redis-server)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

from kvhive.router.index import InMemoryIndex, KVBlockIndex, RedisIndex


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def keys(*ids: int) -> list[bytes]:
    return [key(i) for i in ids]


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A throwaway redis-server on a free port, no persistence; stopped after the module."""
    if shutil.which("redis-server") is None and not os.environ.get("CI"):
        pytest.skip("redis-server is not installed")
    pytest.importorskip("redis")
    import redis

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = str(tmp_path_factory.mktemp("redis"))
    process = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                "--appendonly", "no", "--dir", workdir],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while True:
        try:
            if redis.Redis.from_url(url, socket_timeout=1).ping():
                break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                process.kill()
                raise
            time.sleep(0.02)
    yield url
    process.terminate()
    process.wait(10)


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


def test_in_memory_index_is_a_bounded_lru() -> None:
    index = InMemoryIndex(max_keys=3)
    index.add(keys(0, 1, 2), "a", "GPU")
    assert index.lookup(keys(0)) == [{"a": "GPU"}]    # 0 becomes the most recently used
    index.add(keys(3), "b", "GPU")                    # evicts 1, the least recently used
    assert len(index) == 3
    assert index.lookup(keys(1)) == []
    assert [bool(index.lookup(keys(i))) for i in (0, 2, 3)] == [True, True, True]
    index.clear_replica("a")                          # evicted keys left the replica's set too
    assert len(index) == 1 and index.lookup(keys(3)) == [{"b": "GPU"}]
    with pytest.raises(ValueError):
        InMemoryIndex(max_keys=0)


def test_in_memory_index_many_replicas_and_threads() -> None:
    index = InMemoryIndex(max_keys=100_000)

    def writer(r: int) -> None:
        for i in range(0, 1000, 10):
            index.add(keys(*range(i, i + 10)), f"r{r}", "GPU" if r % 2 else "CPU")

    threads = [threading.Thread(target=writer, args=(r,)) for r in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    hits = index.lookup(keys(*range(1000)))
    assert len(hits) == 1000
    assert hits[500] == {f"r{r}": "GPU" if r % 2 else "CPU" for r in range(20)}


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
