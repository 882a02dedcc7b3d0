"""The gateway's one connection to the Redis that several gateways share (``--redis-url``), and the
block index behind it.

Every Redis call of the gateway (the block index, session affinity) goes through one
``RedisLink``: short socket timeouts, no client-side retries, and a back-off after a call that
could not reach Redis. While it backs off, calls fail fast with ``SharedStateUnavailable`` without
touching the network, and their callers fall back: the index finds nothing (requests are routed
by load), affinity answers from the gateway's own map. After the back-off (doubling from
``base_backoff_s`` to ``max_backoff_s``) the next call tries Redis again, so a stopped or hung
Redis costs at most one timeout per back-off, and every request still gets an answer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvhive.routing.index import KVBlockIndex, RedisIndex

logger = logging.getLogger(__name__)
T = TypeVar("T")


class SharedStateUnavailable(Exception):
    """Redis cannot be reached now (backing off, or this call failed to reach it)."""


class RedisLink:
    """A Redis client with short timeouts behind a back-off (see the module docstring).
    Thread-safe: the event loop, the KV-event ingesters and discovery share it."""

    def __init__(self, url: str, timeout_s: float = 0.25, base_backoff_s: float = 1.0,
                 max_backoff_s: float = 10.0, client: Any = None,
                 fallback: str = "routing by the gateway's own session map and by load, keeping the "
                                 "replicas discovered so far") -> None:
        import redis  # optional dependency: only a gateway with --redis-url needs it
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.url = url
        self.fallback = fallback        # what the gateway does meanwhile, for the log
        self.client = client if client is not None else redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))
        self.unreachable: tuple[type[BaseException], ...] = (redis.ConnectionError, redis.TimeoutError,
                                                             OSError)
        self.base_backoff_s = base_backoff_s
        self.max_backoff_s = max_backoff_s
        self._lock = threading.Lock()
        self._retry_at = 0.0            # monotonic time before which calls fail fast; 0: reachable
        self._backoff_s = base_backoff_s
        self.num_failures = 0           # calls that could not reach Redis, ever

    @property
    def reachable(self) -> bool:
        """Whether the last call reached Redis."""
        return self._retry_at == 0.0

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()`` (Redis calls on ``client``); SharedStateUnavailable while backing off or when
        it cannot reach Redis (which starts or lengthens the back-off)."""
        retry_at = self._retry_at
        if retry_at and time.monotonic() < retry_at:
            raise SharedStateUnavailable(f"Redis {self.url} is unreachable; retrying later")
        try:
            result = fn()
        except self.unreachable as exc:
            self._failed(exc)
            raise SharedStateUnavailable(f"Redis {self.url}: {type(exc).__name__}: {exc}") from exc
        if retry_at:
            self._recovered()
        return result

    def _failed(self, exc: BaseException) -> None:
        with self._lock:
            first = self._retry_at == 0.0
            backoff = self.base_backoff_s if first else min(self._backoff_s * 2, self.max_backoff_s)
            self._backoff_s = backoff
            self._retry_at = time.monotonic() + backoff
            self.num_failures += 1
        if first:
            logger.warning("Redis %s unreachable (%s: %s): %s; retrying in %.0f s", self.url,
                           type(exc).__name__, exc, self.fallback, backoff)

    def _recovered(self) -> None:
        with self._lock:
            was_down = self._retry_at != 0.0
            self._retry_at, self._backoff_s = 0.0, self.base_backoff_s
        if was_down:
            logger.warning("Redis %s reachable again", self.url)

    def close(self) -> None:
        """Close the connection pool."""
        self.client.close()


class GuardedIndex:
    """A KVBlockIndex in Redis behind a ``RedisLink``: while Redis is unreachable a lookup finds
    nothing (the request is routed by load) and updates are dropped (counted in ``num_dropped``);
    the replicas' next events fill the index again."""

    def __init__(self, link: RedisLink, inner: KVBlockIndex | None = None) -> None:
        self.link = link
        self.inner = inner if inner is not None else RedisIndex(link.url, client=link.client)
        self.num_dropped = 0

    def add(self, keys: Sequence[bytes], replica: str, medium: str) -> None:
        """See KVBlockIndex.add (dropped while Redis is unreachable)."""
        self._update(lambda: self.inner.add(keys, replica, medium))

    def remove(self, keys: Sequence[bytes], replica: str, medium: str) -> None:
        """See KVBlockIndex.remove (dropped while Redis is unreachable)."""
        self._update(lambda: self.inner.remove(keys, replica, medium))

    def clear_replica(self, replica: str) -> None:
        """See KVBlockIndex.clear_replica (dropped while Redis is unreachable)."""
        self._update(lambda: self.inner.clear_replica(replica))

    def lookup(self, keys: Sequence[bytes]) -> list[dict[str, str]]:
        """See KVBlockIndex.lookup; nothing found while Redis is unreachable."""
        try:
            return self.link.call(lambda: self.inner.lookup(keys))
        except SharedStateUnavailable:
            return []

    def _update(self, fn: Callable[[], None]) -> None:
        try:
            self.link.call(fn)
        except SharedStateUnavailable:
            self.num_dropped += 1
