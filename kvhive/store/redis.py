"""RedisStore: the shared tier, one Redis value per block, read and written by every replica.

Values are whole codec records (header + payload + checksums), so a value corrupted or written
under the wrong key in Redis decodes to a miss. A block's Redis key is ``key_prefix`` followed by
its encoded store key (``kvhive.sessions.durable`` names the prefix: ``kvhive:{model}:kv:``). Redis does its own eviction (``maxmemory``) and
expiry (``ttl_seconds``); this tier has no budget of its own. A pinned key (``pin``) carries no TTL
(PERSIST; SET without PX) until ``unpin`` gives it the TTL back. Pins are this process's: another
replica's SET of the same block gives it a TTL again, and Redis's ``maxmemory`` policy is the
operator's to choose (``volatile-*`` policies never evict keys without a TTL).

Faults never reach the caller: when Redis is down or slow (connect / socket timeout), the call
returns a miss or False, counts an error and opens the circuit breaker this process shares for
the URL with the session and response backends (``kvhive.store.redis_guard``): every call then returns
at once without touching the network until the breaker's probe finds Redis back (after 1 s,
2 s, 4 s ... 30 s). redis-py reconnects by itself, so a Redis that comes back works again without
a restart. When Redis is full (OOM on SET), only puts back off (``backoff_s``); reads keep working.
Each change of state logs one line.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from kvhive.store.base import Payload, PutResult, StatsCounter, StoreStats
from kvhive.store.codec import decode_block, encode_block
from kvhive.store.key import StoreKey
from kvhive.store.redis_guard import guard_for

logger = logging.getLogger(__name__)
T = TypeVar("T")
_CORRUPT_LOG_INTERVAL_S = 10.0


class RedisStore:
    """Blocks as Redis values (SET with optional TTL), with fault tolerance and reconnect."""

    def __init__(self, url: str, ttl_seconds: float | None = None, timeout_s: float = 0.5,
                 backoff_s: float = 1.0, key_prefix: bytes = b"") -> None:
        """``backoff_s``: how long puts pause when Redis is full, and the breaker's first backoff
        when this store is the first user of ``url`` in the process; ``key_prefix``: what comes
        before every block's encoded key in Redis."""
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        if ttl_seconds is not None and ttl_seconds <= 0:
            raise ValueError(f"redis tier TTL must be > 0 seconds, got {ttl_seconds}")
        if timeout_s <= 0 or backoff_s < 0:
            raise ValueError(f"redis tier timeout must be > 0 and backoff >= 0, got {timeout_s}, {backoff_s}")
        self.url = url
        self.key_prefix = key_prefix
        self.ttl_ms = None if ttl_seconds is None else max(1, int(ttl_seconds * 1000))
        self.backoff_s = backoff_s
        # No client-side retries: a failed call fails fast and the tier backs off instead. Values are
        # ~1 MB, so read in 1 MiB chunks (the 32 KiB default makes GET ~10x slower).
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                            retry=Retry(NoBackoff(), 0), socket_read_size=1 << 20)
        self._guard = guard_for(url, timeout_s=timeout_s, base_backoff_s=max(backoff_s, 0.01))
        self._unreachable_errors = self._guard.unreachable_errors
        self._full_error = redis.exceptions.OutOfMemoryError
        self._redis_error = redis.RedisError
        self._stats = StatsCounter()
        self._lock = threading.Lock()
        # Invariant: a call made while the breaker is not closed (any call) or before _full_until
        # (puts) skips the network.
        self._full_until = 0.0
        self._is_full = False
        self._last_corrupt_log = float("-inf")
        self._pins: set[bytes] = set()     # encoded keys stored without a TTL

    @property
    def available(self) -> bool:
        """False while the breaker is open: every call is a miss or False without a round trip."""
        return self._guard.breaker.allow()

    def contains(self, keys: Sequence[StoreKey]) -> list[bool]:
        """Whether each key exists, in one pipelined round trip; all False while the tier is down."""
        if not keys:
            return []

        def probe() -> list[bool]:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self.redis_key(key))
            return [bool(n) for n in pipe.execute()]

        return self._call(probe, [False] * len(keys), write=False)

    def get(self, key: StoreKey) -> memoryview | None:
        """The payload (a view into the fetched value), or None when absent, corrupt, or the tier is down."""
        start = time.perf_counter()
        value = self._call(lambda: self._client.get(self.redis_key(key)), None, write=False)
        payload = None if value is None else decode_block(value, key)
        if value is not None and payload is None:
            self._stats.record_error()
            now = time.monotonic()
            if now - self._last_corrupt_log >= _CORRUPT_LOG_INTERVAL_S:
                self._last_corrupt_log = now
                logger.warning("redis tier: corrupt or mismatched value under %r is a miss", self.redis_key(key))
        self._stats.record_get(None if payload is None else payload.nbytes, time.perf_counter() - start)
        return payload

    def put(self, key: StoreKey, payload: Payload) -> PutResult:
        """SET the encoded block (with the TTL, if any); False when the tier is down, slow or full."""
        parts = encode_block(key, payload)
        value = b"".join(parts)   # the one copy of the payload: Redis takes a single value
        encoded = self.redis_key(key)
        ttl_ms = None if encoded in self._pins else self.ttl_ms
        stored = self._call(lambda: bool(self._client.set(encoded, value, px=ttl_ms)), False, write=True)
        if stored:
            self._stats.record_put(memoryview(parts[1]).nbytes)
        return PutResult(stored)

    def delete(self, key: StoreKey) -> None:
        """DEL the block (for every replica sharing this Redis)."""
        self._call(lambda: self._client.delete(self.redis_key(key)), 0, write=False)

    def pin(self, keys: Iterable[StoreKey]) -> None:
        """Take the TTL off these keys (held now or stored later) so Redis does not expire them."""
        encoded = [self.redis_key(key) for key in keys]
        with self._lock:
            self._pins.update(encoded)
        if self.ttl_ms is not None and encoded:
            self._pipelined(lambda pipe, k: pipe.persist(k), encoded)

    def unpin(self, keys: Iterable[StoreKey]) -> None:
        """Give these keys the tier's TTL back."""
        encoded = [self.redis_key(key) for key in keys]
        with self._lock:
            self._pins.difference_update(encoded)
        if self.ttl_ms is not None and encoded:
            self._pipelined(lambda pipe, k: pipe.pexpire(k, self.ttl_ms), encoded)

    def redis_key(self, key: StoreKey) -> bytes:
        """The block's Redis key."""
        return self.key_prefix + key.encode()

    def _pipelined(self, command: Callable, encoded: list[bytes]) -> None:
        def run() -> None:
            pipe = self._client.pipeline(transaction=False)
            for k in encoded:
                command(pipe, k)
            pipe.execute()

        self._call(run, None, write=False)

    def stats(self) -> StoreStats:
        """Counters; usage and budget are Redis's own (None here)."""
        return self._stats.snapshot(None, None)

    def close(self) -> None:
        """Close the connection pool."""
        self._client.close()

    def _call(self, fn: Callable[[], T], default: T, *, write: bool) -> T:
        """Run one Redis call; on a fault return ``default``, count an error and back off."""
        if not self._guard.breaker.allow() or (write and time.monotonic() < self._full_until):
            return default
        try:
            result = fn()
        except self._full_error as exc:
            self._stats.record_error()
            with self._lock:
                self._full_until = time.monotonic() + self.backoff_s
                if not self._is_full:
                    self._is_full = True
                    logger.warning("redis tier %s is full (%s); puts pause for %.1fs at a time",
                                   self._guard.breaker.name, exc, self.backoff_s)
            return default
        except self._unreachable_errors as exc:
            self._stats.record_error()
            self._guard.breaker.record_failure(exc)        # logs once, probes in the background
            return default
        except self._redis_error as exc:
            self._stats.record_error()
            logger.warning("redis tier %s: %s: %s", self._guard.breaker.name, type(exc).__name__, exc)
            return default
        if write and self._is_full:
            with self._lock:
                if self._is_full:
                    logger.warning("redis tier %s accepts writes again", self._guard.breaker.name)
                self._is_full = False
        return result
