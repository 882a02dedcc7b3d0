"""MemoryStore: the host-memory tier, an LRU of block payloads under a byte budget."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

from kvhive.store.base import Evicted, Payload, PutResult, StatsCounter, StoreStats
from kvhive.store.codec import as_bytes_view
from kvhive.store.key import StoreKey


class MemoryStore:
    """LRU of block payloads in process memory; put evicts least recently used blocks to fit the budget.

    Payloads are kept raw (no header, no checksum): process memory is trusted. Evicted blocks are
    returned from put (PutResult.evicted) so a TieredStore can copy them down a tier.
    """

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"memory tier budget must be > 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        # Invariant: order is least -> most recently used; used_bytes == sum of len(payload).
        self._blocks: OrderedDict[StoreKey, bytes] = OrderedDict()
        self._used_bytes = 0
        self._stats = StatsCounter()

    def contains(self, keys: Sequence[StoreKey]) -> list[bool]:
        """Whether each key is held; recency is unchanged."""
        with self._lock:
            return [key in self._blocks for key in keys]

    def get(self, key: StoreKey) -> bytes | None:
        """The payload (shared, immutable bytes), marked most recently used; None on a miss."""
        start = time.perf_counter()
        with self._lock:
            payload = self._blocks.get(key)
            if payload is not None:
                self._blocks.move_to_end(key)
        self._stats.record_get(None if payload is None else len(payload), time.perf_counter() - start)
        return payload

    def put(self, key: StoreKey, payload: Payload) -> PutResult:
        """Store a copy of the payload as most recently used; returns the blocks evicted to fit it."""
        # bytes are immutable and kept as is; anything else is copied once, outside the lock.
        data = payload if isinstance(payload, bytes) else as_bytes_view(payload).tobytes()
        if len(data) > self.budget_bytes:
            return PutResult(False)
        evicted: list[Evicted] = []
        with self._lock:
            old = self._blocks.pop(key, None)
            if old is not None:
                self._used_bytes -= len(old)
            self._blocks[key] = data
            self._used_bytes += len(data)
            while self._used_bytes > self.budget_bytes:
                old_key, old_data = self._blocks.popitem(last=False)
                self._used_bytes -= len(old_data)
                evicted.append(Evicted(old_key, old_data))
        self._stats.record_put(len(data))
        if evicted:
            self._stats.record_evictions(len(evicted))
        return PutResult(True, tuple(evicted))

    def delete(self, key: StoreKey) -> None:
        """Drop the block, if held."""
        with self._lock:
            old = self._blocks.pop(key, None)
            if old is not None:
                self._used_bytes -= len(old)

    def stats(self) -> StoreStats:
        """Counters, bytes held and the budget."""
        with self._lock:
            used = self._used_bytes
        return self._stats.snapshot(used, self.budget_bytes)

    def close(self) -> None:
        """Drop every block (nothing in memory survives a restart)."""
        with self._lock:
            self._blocks.clear()
            self._used_bytes = 0
