"""RedisStore against a real redis-server: round trips, corrupt values, and down / slow / full faults
(the shared circuit breaker: fast misses while open, its probe closes it again)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

redis = pytest.importorskip("redis")
from support.redis_server import RedisServer, needs_redis_server  # noqa: E402
from support.servers import wait_until  # noqa: E402

from kvhive.store.key import KeySpace  # noqa: E402
from kvhive.store.redis import RedisStore  # noqa: E402

# CI installs redis-server (scripts/test.sh); there a missing server is a failure, not a skip.
pytestmark = needs_redis_server

SPACE = KeySpace("test-model", 1, "float32", 16)
BLOCK = 50_000
TIMEOUT_S = 0.2
BACKOFF_S = 0.3


def key(i: int):
    return SPACE.key(i.to_bytes(16, "little"))


def payload(i: int) -> bytes:
    return (i.to_bytes(4, "little") * (BLOCK // 4 + 1))[:BLOCK]


@pytest.fixture()
def store(redis_server: RedisServer) -> Iterator[RedisStore]:
    s = RedisStore(redis_server.url, timeout_s=TIMEOUT_S, backoff_s=BACKOFF_S)
    yield s
    s.close()


def timed(fn, *args) -> float:
    """Seconds one call takes."""
    start = time.monotonic()
    fn(*args)
    return time.monotonic() - start


def test_put_get_contains_delete(store: RedisStore):
    assert store.get(key(1)) is None
    assert store.contains([]) == []
    assert store.put(key(1), payload(1))
    assert store.put(key(2), bytearray(payload(2)))
    assert bytes(store.get(key(1))) == payload(1)
    assert store.contains([key(1), key(3), key(2)]) == [True, False, True]
    store.delete(key(1))
    assert store.get(key(1)) is None
    s = store.stats()
    assert (s.hits, s.misses, s.bytes_in, s.bytes_out, s.errors) == (1, 2, 2 * BLOCK, BLOCK, 0)
    assert s.used_bytes is None and s.budget_bytes is None


def test_ttl_is_set_on_every_block(redis_server: RedisServer):
    store = RedisStore(redis_server.url, ttl_seconds=0.2)
    assert store.put(key(1), payload(1))
    assert 0 < redis_server.admin().pttl(key(1).encode()) <= 200
    store.close()


def test_pinned_blocks_carry_no_ttl_until_unpinned(redis_server: RedisServer):
    store = RedisStore(redis_server.url, ttl_seconds=0.5)
    admin = redis_server.admin()
    assert store.put(key(1), payload(1))
    store.pin([key(1), key(2)])                       # key 2 is pinned before it is stored
    assert store.put(key(2), payload(2)) and store.put(key(3), payload(3))
    assert admin.pttl(key(1).encode()) == -1 and admin.pttl(key(2).encode()) == -1
    time.sleep(0.7)
    assert store.contains([key(1), key(2), key(3)]) == [True, True, False]
    store.unpin([key(1)])
    assert 0 < admin.pttl(key(1).encode()) <= 500
    assert admin.pttl(key(2).encode()) == -1
    store.close()


def test_corrupt_or_misnamed_value_is_a_miss(store: RedisStore, redis_server: RedisServer):
    admin = redis_server.admin()
    store.put(key(1), payload(1))
    raw = bytearray(admin.get(key(1).encode()))
    raw[-10] ^= 0xFF
    admin.set(key(1).encode(), bytes(raw))
    assert store.get(key(1)) is None
    admin.set(key(2).encode(), b"garbage")
    assert store.get(key(2)) is None
    store.put(key(3), payload(3))
    admin.copy(key(3).encode(), key(4).encode())           # a valid object under the wrong name
    assert store.get(key(4)) is None
    assert bytes(store.get(key(3))) == payload(3)
    assert store.stats().errors == 3


def test_server_down_means_fast_misses_then_recovery_without_restart(store: RedisStore, redis_server: RedisServer):
    store.put(key(1), payload(1))
    redis_server.stop()
    for _ in range(2):                                     # the first call fails, the second backs off
        assert timed(store.get, key(1)) < 1.0
        assert timed(store.put, key(2), payload(2)) < 1.0
        assert timed(store.contains, [key(1), key(2)]) < 1.0
    assert store.get(key(1)) is None
    assert not store.put(key(2), payload(2))
    assert store.contains([key(1), key(2)]) == [False, False]
    store.delete(key(1))
    assert store.stats().errors >= 1
    redis_server.start()                                         # same port, empty (no persistence)
    wait_until(lambda: store.available, 10, "the store")  # the breaker's probe found it back
    assert store.put(key(1), payload(1))                   # the same store object reconnects
    assert bytes(store.get(key(1))) == payload(1)


def test_slow_server_times_out_fast_and_recovers(store: RedisStore, redis_server: RedisServer):
    store.put(key(1), payload(1))
    os.kill(redis_server.process.pid, signal.SIGSTOP)            # a hung server: connections open, no answers
    errors_before = store.stats().errors
    assert timed(store.get, key(1)) < 1.0                  # times out after TIMEOUT_S
    assert timed(store.put, key(2), payload(2)) < 0.1      # backing off: no network call at all
    assert store.get(key(1)) is None
    assert store.stats().errors == errors_before + 1
    os.kill(redis_server.process.pid, signal.SIGCONT)
    wait_until(lambda: store.available, 10, "the store")
    assert bytes(store.get(key(1))) == payload(1)
    assert store.put(key(2), payload(2))


def test_full_server_refuses_puts_but_keeps_serving_reads(store: RedisStore, redis_server: RedisServer):
    admin = redis_server.admin()
    assert store.put(key(1), payload(1))
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", "1mb")                   # below what Redis already uses
    assert timed(store.put, key(2), payload(2)) < 1.0
    assert store.stats().errors == 1
    assert not store.put(key(3), payload(3))
    assert bytes(store.get(key(1))) == payload(1)          # reads still work while puts back off
    assert store.contains([key(1), key(2)]) == [True, False]
    admin.config_set("maxmemory", "0")
    time.sleep(BACKOFF_S + 0.05)
    assert store.put(key(2), payload(2))
    assert bytes(store.get(key(2))) == payload(2)
