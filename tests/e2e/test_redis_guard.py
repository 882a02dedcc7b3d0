"""The circuit breaker in front of Redis (a fake probe), and the guard of one URL against a real
redis-server: fast failures while open, growing backoff, one log line per change of state,
listeners on recovery and on lost data."""

from __future__ import annotations

import logging
import os
import shutil
import time

import pytest

from kvhive.store.redis_guard import CLOSED, OPEN, CircuitBreaker, RedisUnavailable, guard_for, redacted


class FlakyProbe:
    """A probe that fails until ``healthy`` is set, and notes when it was called."""

    def __init__(self) -> None:
        self.healthy = False
        self.calls: list[float] = []

    def __call__(self) -> None:
        self.calls.append(time.monotonic())
        if not self.healthy:
            raise ConnectionError("refused")


def wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def test_breaker_opens_backs_off_growing_and_closes_once(caplog):
    caplog.set_level(logging.WARNING, logger="kvhive.store.redis_guard")
    probe = FlakyProbe()
    breaker = CircuitBreaker("test", probe, base_backoff_s=0.05, max_backoff_s=0.2)
    closed: list[str] = []
    breaker.on_close(lambda: closed.append(breaker.state))
    assert breaker.allow()
    opened = time.monotonic()
    breaker.record_failure(ConnectionError("refused"))
    breaker.record_failure(ConnectionError("refused"))          # already open: nothing more
    assert breaker.state == OPEN and not breaker.allow()
    wait_until(lambda: len(probe.calls) >= 4)
    calls = list(probe.calls)
    gaps = [b - a for a, b in zip([opened, *calls[:-1]], calls, strict=True)]
    assert gaps[0] >= 0.04 and gaps[1] >= 0.09 and gaps[2] >= 0.18      # 0.05, 0.1, 0.2 ...
    assert not breaker.allow()
    probe.healthy = True
    wait_until(breaker.allow)
    assert breaker.state == CLOSED and closed and closed[0] != CLOSED    # told before calls pass
    lines = [r.getMessage() for r in caplog.records]
    assert sum("unreachable" in line for line in lines) == 1
    assert sum(" back after " in line for line in lines) == 1


def test_redacted_hides_the_password():
    assert redacted("redis://user:secret@host:6379/0") == "redis://user:***@host:6379/0"
    assert redacted("redis://host:6379/0") == "redis://host:6379/0"


@pytest.fixture()
def redis_server(tmp_path):
    if shutil.which("redis-server") is None and not os.environ.get("CI"):
        pytest.skip("redis-server is not installed")
    from test_store_redis import RedisServer, _free_port

    server = RedisServer(_free_port(), str(tmp_path))
    server.start()
    yield server
    server.stop()


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
    wait_until(guard.breaker.allow)
    assert told == ["told", "told"]                                 # recovered: republish again
    assert guard.read(lambda: guard.client.get("k")) is None        # restarted empty
