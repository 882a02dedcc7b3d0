"""MemoryStore: the host-memory tier, an LRU of block payloads under a byte budget, with pins."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvhive.store.base import Evicted, Payload, PutResult, StatsCounter, StoreStats
from kvhive.store.codec import as_bytes_view
from kvhive.store.key import StoreKey


class MemoryStore:
    """LRU of block payloads in process memory; put evicts least recently used blocks to fit the budget.

    Payloads are kept raw (no header, no checksum): process memory is trusted. Evicted blocks are
    returned from put (PutResult.evicted) so a TieredStore can copy them down a tier.

    Pinned keys (``pin``) are never evicted: their blocks count against the budget but sit outside
    the LRU order. A put whose block does not fit beside the pinned ones is refused (stored False)
    without evicting anything; otherwise only unpinned blocks are evicted to make room.
    """

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"memory tier budget must be > 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        # Invariants: a key is in at most one of _blocks and _pinned_blocks, and in _pinned_blocks
        # exactly when it is in _pins; _blocks is ordered least -> most recently used;
        # used_bytes == sum of len(payload) over both maps; pinned_bytes the same over _pinned_blocks.
        self._blocks: OrderedDict[StoreKey, bytes] = OrderedDict()
        self._pinned_blocks: dict[StoreKey, bytes] = {}
        self._pins: set[StoreKey] = set()
        self._used_bytes = 0
        self._pinned_bytes = 0
        self._stats = StatsCounter()

    def contains(self, keys: Sequence[StoreKey]) -> list[bool]:
        """Whether each key is held; recency is unchanged."""
        with self._lock:
            return [key in self._blocks or key in self._pinned_blocks for key in keys]

    def get(self, key: StoreKey) -> bytes | None:
        """The payload (shared, immutable bytes), marked most recently used; None on a miss."""
        start = time.perf_counter()
        with self._lock:
            payload = self._pinned_blocks.get(key)
            if payload is None:
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
            held_pinned = self._pinned_blocks.get(key)
            if self._pinned_bytes - len(held_pinned or b"") + len(data) > self.budget_bytes:
                return PutResult(False)       # the budget is all pinned: evicting would not help
            self._drop(key)
            pinned = key in self._pins
            (self._pinned_blocks if pinned else self._blocks)[key] = data
            self._used_bytes += len(data)
            self._pinned_bytes += len(data) if pinned else 0
            # Unpinned blocks leave least recently used first; the new one is the most recent.
            while self._used_bytes > self.budget_bytes:
                old_key, old_data = self._blocks.popitem(last=False)
                self._used_bytes -= len(old_data)
                evicted.append(Evicted(old_key, old_data))
        self._stats.record_put(len(data))
        if evicted:
            self._stats.record_evictions(len(evicted))
        return PutResult(True, tuple(evicted))

    def delete(self, key: StoreKey) -> None:
        """Drop the block, if held (a pin on its key stays)."""
        with self._lock:
            self._drop(key)

    def pin(self, keys: Iterable[StoreKey]) -> None:
        """Never evict these keys' blocks, held now or stored later, until ``unpin``."""
        with self._lock:
            for key in keys:
                self._pins.add(key)
                data = self._blocks.pop(key, None)
                if data is not None:
                    self._pinned_blocks[key] = data
                    self._pinned_bytes += len(data)

    def unpin(self, keys: Iterable[StoreKey]) -> None:
        """Make these keys' blocks evictable again, as most recently used."""
        with self._lock:
            for key in keys:
                self._pins.discard(key)
                data = self._pinned_blocks.pop(key, None)
                if data is not None:
                    self._blocks[key] = data
                    self._pinned_bytes -= len(data)

    def held_hashes(self, prefix: bytes) -> list[bytes]:
        """Block hashes of the held blocks whose encoded key starts with ``prefix`` (a key space)."""
        with self._lock:
            keys = [*self._blocks, *self._pinned_blocks]
        return [key.block_hash for key in keys if key.encode().startswith(prefix)]

    def drop_unpinned(self) -> int:
        """Drop every block no pin keeps; returns how many."""
        with self._lock:
            dropped = len(self._blocks)
            self._blocks.clear()
            self._used_bytes = self._pinned_bytes
        return dropped

    def stats(self) -> StoreStats:
        """Counters, bytes held and the budget."""
        with self._lock:
            used = self._used_bytes
        return self._stats.snapshot(used, self.budget_bytes)

    def close(self) -> None:
        """Drop every block (nothing in memory survives a restart)."""
        with self._lock:
            self._blocks.clear()
            self._pinned_blocks.clear()
            self._used_bytes = self._pinned_bytes = 0

    def _drop(self, key: StoreKey) -> None:
        # Lock held.
        old = self._blocks.pop(key, None)
        if old is None:
            old = self._pinned_blocks.pop(key, None)
            if old is not None:
                self._pinned_bytes -= len(old)
        if old is not None:
            self._used_bytes -= len(old)
