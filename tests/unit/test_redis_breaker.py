"""The circuit breaker in front of Redis, with a fake probe: fast failures while open, growing
backoff, one log line per change of state; and the URL redaction of its log lines."""

from __future__ import annotations

import logging
import time

from support.servers import wait_until

from kvhive.store.redis_guard import CLOSED, OPEN, CircuitBreaker, redacted


class FlakyProbe:
    """A probe that fails until ``healthy`` is set, and notes when it was called."""

    def __init__(self) -> None:
        self.healthy = False
        self.calls: list[float] = []

    def __call__(self) -> None:
        self.calls.append(time.monotonic())
        if not self.healthy:
            raise ConnectionError("refused")


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
    wait_until(lambda: len(probe.calls) >= 4, 10, "four probes")
    calls = list(probe.calls)
    gaps = [b - a for a, b in zip([opened, *calls[:-1]], calls, strict=True)]
    assert gaps[0] >= 0.04 and gaps[1] >= 0.09 and gaps[2] >= 0.18      # 0.05, 0.1, 0.2 ...
    assert not breaker.allow()
    probe.healthy = True
    wait_until(breaker.allow, 10, "the breaker to close")
    assert breaker.state == CLOSED and closed and closed[0] != CLOSED    # told before calls pass
    lines = [r.getMessage() for r in caplog.records]
    assert sum("unreachable" in line for line in lines) == 1
    assert sum(" back after " in line for line in lines) == 1


def test_redacted_hides_the_password():
    assert redacted("redis://user:secret@host:6379/0") == "redis://user:***@host:6379/0"
    assert redacted("redis://host:6379/0") == "redis://host:6379/0"
