"""The guard of one Redis URL against a real redis-server: fast failures while down, listeners told
on recovery and on lost data."""

from __future__ import annotations

import time

import pytest
from support.servers import wait_until

from kvhive.store.redis_guard import RedisUnavailable, guard_for


def test_guard_fails_fast_while_down_and_tells_listeners_on_recovery_and_on_lost_data(redis_server):
    guard = guard_for(redis_server.url, timeout_s=0.2, base_backoff_s=0.1)
    told: list[str] = []
    guard.add_listener(lambda: told.append("told"))
    guard.write(lambda: guard.client.set("k", "v"), "k")          # the first write notes the marker
    assert guard.read(lambda: guard.client.get("k")) == b"v"        # in order after the write
    assert not guard.read(guard.check_data)
    redis_server.admin().flushall()
    assert guard.read(guard.check_data) and told == ["told"]       # lost: the listeners republish
    assert not guard.read(guard.check_data)                         # noted: not lost twice
    redis_server.stop()
    with pytest.raises(RedisUnavailable):
        guard.read(lambda: guard.client.get("k"))
    start = time.monotonic()
    with pytest.raises(RedisUnavailable):                           # open: no network at all
        guard.read(lambda: guard.client.get("k"))
    assert time.monotonic() - start < 0.1
    redis_server.start()
    wait_until(guard.breaker.allow, 10, "the guard to recover")
    assert told == ["told", "told"]                                 # recovered: republish again
    assert guard.read(lambda: guard.client.get("k")) is None        # restarted empty
