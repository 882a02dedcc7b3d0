"""The BlockStore protocol every tier implements, and the named types it returns.

A store maps a StoreKey to one block's payload: the block's K and V for all layers, one
contiguous byte range of the device pool (``kv_cache[block_id]``). Payloads are bytes-like
(``bytes``, ``bytearray``, ``memoryview``, or a C-contiguous numpy array); stores never see
tensors. Every call is safe from any thread: loads and saves run on background threads.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from kvhive.store.key import StoreKey

Payload = bytes | bytearray | memoryview   # or any C-contiguous buffer (a numpy array)


class Evicted(NamedTuple):
    """A block a tier dropped to stay in budget, handed back so the tier below can keep it."""

    key: StoreKey
    payload: bytes


@dataclass(frozen=True)
class PutResult:
    """What a put did: whether the block is stored, and what the tier evicted to make room."""

    stored: bool
    evicted: tuple[Evicted, ...] = ()

    def __bool__(self) -> bool:
        """Truthy when the block is stored, so ``if store.put(...)`` reads as expected."""
        return self.stored


@dataclass(frozen=True)
class StoreStats:
    """A snapshot of one tier's counters; hits and misses are in blocks (times block size = tokens)."""

    hits: int = 0                  # get calls that returned a payload
    misses: int = 0                # get calls that returned None (absent, corrupt, or tier down)
    bytes_in: int = 0              # payload bytes stored by put
    bytes_out: int = 0             # payload bytes returned by get
    evictions: int = 0             # blocks dropped to stay within the budget
    errors: int = 0                # failed I/O or network calls, and corrupt objects found
    used_bytes: int | None = 0     # None where the tier cannot tell (Redis)
    budget_bytes: int | None = 0   # None where the tier has no budget of its own (Redis)
    load_seconds_sum: float = 0.0  # total time spent in get, hit or miss
    load_count: int = 0            # number of get calls timed
    write_errors: int = 0          # writes that failed (disk full, I/O error); each block a miss


class StatsCounter:
    """Thread-safe counters behind a store's stats()."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hits = self._misses = self._bytes_in = self._bytes_out = 0
        self._evictions = self._errors = self._load_count = self._write_errors = 0
        self._load_seconds = 0.0

    def record_get(self, payload_len: int | None, seconds: float) -> None:
        """Count one get: a hit of ``payload_len`` bytes, or a miss when it is None."""
        with self._lock:
            if payload_len is None:
                self._misses += 1
            else:
                self._hits += 1
                self._bytes_out += payload_len
            self._load_seconds += seconds
            self._load_count += 1

    def record_put(self, payload_len: int) -> None:
        """Count one stored block."""
        with self._lock:
            self._bytes_in += payload_len

    def record_evictions(self, num_blocks: int) -> None:
        """Count blocks dropped to stay within the budget."""
        with self._lock:
            self._evictions += num_blocks

    def record_error(self) -> None:
        """Count one failed call or corrupt object."""
        with self._lock:
            self._errors += 1

    def record_write_error(self) -> None:
        """Count one failed write (also a failed call, in ``errors``)."""
        with self._lock:
            self._errors += 1
            self._write_errors += 1

    def snapshot(self, used_bytes: int | None, budget_bytes: int | None) -> StoreStats:
        """The counters now, with the tier's current usage and budget."""
        with self._lock:
            return StoreStats(self._hits, self._misses, self._bytes_in, self._bytes_out, self._evictions,
                              self._errors, used_bytes, budget_bytes, self._load_seconds, self._load_count,
                              self._write_errors)


class BlockStore(Protocol):
    """One tier of KV blocks keyed by StoreKey: memory, disk or Redis."""

    def contains(self, keys: Sequence[StoreKey]) -> list[bool]:
        """Whether each key is stored (one batched probe); changes nothing, not even recency.

        True is a hint, not a promise: the block may be evicted, or found corrupt, before a get.
        """
        ...

    def get(self, key: StoreKey) -> Payload | None:
        """The block's payload (read-only; copy it out), or None on a miss; marks it recently used."""
        ...

    def put(self, key: StoreKey, payload: Payload) -> PutResult:
        """Store a copy of the payload (the caller may reuse its buffer), evicting LRU blocks if needed."""
        ...

    def delete(self, key: StoreKey) -> None:
        """Forget the block, if stored."""
        ...

    def pin(self, keys: Iterable[StoreKey]) -> None:
        """Keep these keys' blocks (held now or stored later) out of eviction until ``unpin``."""
        ...

    def unpin(self, keys: Iterable[StoreKey]) -> None:
        """Let these keys' blocks be evicted again (a key never pinned is ignored)."""
        ...

    def stats(self) -> StoreStats:
        """A snapshot of the tier's counters, usage and budget."""
        ...

    def close(self) -> None:
        """Flush what must survive a restart and release files and connections."""
        ...
