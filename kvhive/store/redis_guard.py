"""One Redis server as this process sees it: one circuit breaker, one thread for records, and a
marker that tells when Redis has lost its data.

Every user of one Redis URL in the process (the KV tier, the session backend, the response
backend) shares one ``RedisGuard`` (``guard_for``; the first caller's timeouts and backoffs hold).

- Circuit breaker (``CircuitBreaker``). Closed: calls go to Redis. A call that cannot reach it
  (connection refused, timeout) opens it: every call then fails fast (a miss, False, or
  ``RedisUnavailable``) without touching the network. While open, a probe thread half-opens it
  after a backoff that doubles from ``base_backoff_s`` up to ``max_backoff_s`` (1 s, 2 s, 4 s ...
  30 s) and PINGs; success closes it, failure opens it for the next backoff. Callers never probe,
  so no request waits on a probe. Each change between closed and open logs one line ("Redis ...
  unreachable ..., retrying in N s" and "Redis ... back").
- Records (``run``, ``submit``, ``write``): session and stored-response records are read and
  written on one thread per URL, in order, so a read sees every write this process queued before
  it, and none of them runs on the HTTP event loop. Writes are fire-and-forget: one the breaker
  refuses is dropped, and the listeners republish on recovery.
- Listeners (``add_listener``): called (from any thread; they must only take note) whenever the
  records this process holds may be missing from Redis: when the breaker closes (writes were
  dropped meanwhile) and when ``check_data`` finds that Redis lost its data.
- Data marker: key ``DATA_MARKER_KEY`` holds a random value that each process notes before its
  first record write. Missing or changed since means Redis lost its data (FLUSHALL, a restart
  without persistence, an eviction of the marker); ``check_data`` then sets it again and calls the
  listeners. (A marker evicted under ``allkeys-*`` policies reads as lost data: records held here
  are republished, even one another replica deleted meanwhile.)
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from kvhive.core.redis_check import redacted

logger = logging.getLogger(__name__)
T = TypeVar("T")

DATA_MARKER_KEY = "kvhive:data-marker"
DEFAULT_BASE_BACKOFF_S = 1.0
DEFAULT_MAX_BACKOFF_S = 30.0

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half-open"


class RedisUnavailable(Exception):
    """Redis cannot be reached now (the breaker is open, or this call failed to reach it)."""


async def check_backend_data(backend: object) -> bool:
    """Run a shared backend's ``check_data`` off the event loop (a loss found there marks a republish
    as wanted through the guard's listeners); False where it did not run (no such check, or Redis
    unreachable: its breaker republishes on recovery)."""
    check_data = getattr(backend, "check_data", None)
    if check_data is None:
        return False
    try:
        await asyncio.to_thread(check_data)
    except Exception:  # noqa: BLE001 - unreachable: the breaker's recovery covers it
        return False
    return True


def backend_lost_data(backend: object) -> bool:
    """For a record held here and missing from a shared backend: whether the backend lost its data
    (its ``check_data``), True when that cannot be told (keep what is held here). Blocking."""
    check_data = getattr(backend, "check_data", None)
    try:
        return bool(check_data is not None and check_data())
    except Exception:  # noqa: BLE001 - cannot tell: keep what this replica holds
        return True


class CircuitBreaker:
    """Closed / open / half-open in front of one server; a probe thread closes it again."""

    def __init__(self, name: str, probe: Callable[[], object], base_backoff_s: float = DEFAULT_BASE_BACKOFF_S,
                 max_backoff_s: float = DEFAULT_MAX_BACKOFF_S) -> None:
        if base_backoff_s <= 0 or max_backoff_s < base_backoff_s:
            raise ValueError(f"backoffs must satisfy 0 < base <= max, got {base_backoff_s}, {max_backoff_s}")
        self.name = name
        self.probe = probe
        self.base_backoff_s = base_backoff_s
        self.max_backoff_s = max_backoff_s
        self._lock = threading.Lock()
        self._state = CLOSED
        self._opened_at = 0.0
        self._on_close: list[Callable[[], None]] = []
        self.num_opens = 0            # times it opened since start

    @property
    def state(self) -> str:
        """CLOSED, OPEN or HALF_OPEN."""
        return self._state

    def allow(self) -> bool:
        """True when calls may go to the server (closed); False: fail fast."""
        return self._state == CLOSED

    def on_close(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the probe thread) each time the breaker closes after an outage,
        just before calls may pass again."""
        self._on_close.append(callback)

    def record_failure(self, exc: BaseException) -> None:
        """A call could not reach the server: open (once) and start probing."""
        with self._lock:
            if self._state != CLOSED:
                return
            self._state = OPEN
            self._opened_at = time.monotonic()
            self.num_opens += 1
        logger.warning("Redis %s unreachable (%s: %s); its calls fail fast, retrying in %.0f s",
                       self.name, type(exc).__name__, exc, self.base_backoff_s)
        threading.Thread(target=self._probe_loop, name="kvhive-redis-probe", daemon=True).start()

    def _probe_loop(self) -> None:
        # Invariant: exactly one probe thread runs while the breaker is not closed.
        backoff = self.base_backoff_s
        while True:
            time.sleep(backoff)
            with self._lock:
                self._state = HALF_OPEN
            try:
                self.probe()
            except Exception as exc:  # noqa: BLE001 - any failure keeps it open
                backoff = min(backoff * 2, self.max_backoff_s)
                with self._lock:
                    self._state = OPEN
                logger.debug("Redis %s still unreachable (%s); retrying in %.0f s", self.name, exc, backoff)
                continue
            # The callbacks run before calls may pass again, so what they note is there first.
            for callback in list(self._on_close):
                try:
                    callback()
                except Exception:  # noqa: BLE001 - one listener must not stop the others
                    logger.exception("Redis %s: a recovery listener failed", self.name)
            with self._lock:
                self._state = CLOSED
                down_s = time.monotonic() - self._opened_at
            logger.warning("Redis %s back after %.1f s", self.name, down_s)
            return


class RedisGuard:
    """The breaker, the record thread and the data marker of one Redis URL (see the module docstring)."""

    def __init__(self, url: str, timeout_s: float = 0.5, base_backoff_s: float = DEFAULT_BASE_BACKOFF_S,
                 max_backoff_s: float = DEFAULT_MAX_BACKOFF_S) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.url = url
        self.timeout_s = timeout_s
        # No client-side retries: a failed call fails fast and the breaker backs off instead.
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                           retry=Retry(NoBackoff(), 0))
        self.unreachable_errors: tuple[type[BaseException], ...] = (redis.ConnectionError, redis.TimeoutError,
                                                                    OSError)
        self.breaker = CircuitBreaker(redacted(url), self.client.ping, base_backoff_s, max_backoff_s)
        self.breaker.on_close(self._recovered)
        self._io = ThreadPoolExecutor(1, thread_name_prefix="kvhive-redis-records")
        self._lock = threading.Lock()
        self._marker: bytes | None = None          # the marker's value when last seen
        self._listeners: list[Callable[[], None]] = []

    # ------------------------------------------------------------------ calls

    def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` (one Redis call) behind the breaker; RedisUnavailable when open or unreachable."""
        if not self.breaker.allow():
            raise RedisUnavailable(f"Redis {self.breaker.name} is unreachable; retrying in the background")
        try:
            return fn()
        except self.unreachable_errors as exc:
            self.breaker.record_failure(exc)
            raise RedisUnavailable(f"Redis {self.breaker.name}: {type(exc).__name__}: {exc}") from exc

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """``run(fn)`` on the record thread, after every call queued before it."""
        return self._io.submit(self.run, fn)

    def read(self, fn: Callable[[], T]) -> T:
        """``submit(fn)`` and wait for its result (for callers off the event loop)."""
        return self.submit(fn).result()

    def write(self, fn: Callable[[], object], what: str) -> None:
        """Queue a write; a failure is logged (quietly while the breaker is open), never raised.
        The first write makes sure the data marker is there (so its loss can be seen)."""
        def write_once_marked() -> object:
            if self._marker is None:
                self.check_data()
            return fn()

        def done(future: Future) -> None:
            exc = future.exception()
            if isinstance(exc, RedisUnavailable):
                logger.debug("Redis write of %s dropped: %s", what, exc)
            elif exc is not None:
                logger.error("Redis write of %s failed: %s: %s", what, type(exc).__name__, exc)

        self.submit(write_once_marked).add_done_callback(done)

    # ------------------------------------------------------------------ lost data

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when records held here may be missing from Redis (see the module docstring)."""
        with self._lock:
            self._listeners.append(callback)

    def check_data(self) -> bool:
        """True (and the listeners told) when Redis lost its data since this process last looked
        (the marker is missing, or another process set it again since); the first look only
        notes the marker (setting it if missing). RedisUnavailable when it cannot tell. Blocking:
        call it off the event loop."""
        value = self.run(lambda: self.client.get(DATA_MARKER_KEY))
        if value is None:
            self.run(lambda: self.client.set(DATA_MARKER_KEY, uuid.uuid4().hex, nx=True))
            value = self.run(lambda: self.client.get(DATA_MARKER_KEY))
        with self._lock:
            lost = self._marker is not None and value != self._marker
            self._marker = value
        if lost:
            logger.warning("Redis %s lost its data; republishing the records this replica holds",
                           self.breaker.name)
            self._notify()
        return lost

    def _recovered(self) -> None:
        """On the probe thread, as the breaker closes: writes were dropped meanwhile (and Redis
        may have restarted empty), so the listeners republish."""
        self._notify()

    def _notify(self) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for callback in listeners:
            try:
                callback()
            except Exception:  # noqa: BLE001 - one listener must not stop the others
                logger.exception("Redis %s: a listener failed", self.breaker.name)


_guards: dict[str, RedisGuard] = {}
_guards_lock = threading.Lock()


def guard_for(url: str, timeout_s: float = 0.5, base_backoff_s: float = DEFAULT_BASE_BACKOFF_S,
              max_backoff_s: float = DEFAULT_MAX_BACKOFF_S) -> RedisGuard:
    """This process's guard of ``url``, made by the first caller (whose settings it keeps)."""
    with _guards_lock:
        guard = _guards.get(url)
        if guard is None:
            guard = _guards[url] = RedisGuard(url, timeout_s, base_backoff_s, max_backoff_s)
        return guard
