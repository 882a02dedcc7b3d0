"""Counters of one instance's KV transfers (the server turns them into metrics, per role)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

# Upper bounds (seconds) of the transfer-time histogram: a layer frame sent (prefill) or a whole
# remote load (decode).
TRANSFER_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0)


@dataclass(frozen=True)
class KVTransferStats:
    """A snapshot of one instance's transfer counters (cumulative) for /metrics."""

    role: str
    sent_bytes: int
    sent_blocks: int
    skipped_blocks: int
    send_failures: int
    received_bytes: int
    received_blocks: int
    recomputed_blocks: int
    fallback_blocks: int
    failed_transfers: int
    time_buckets: tuple[int, ...]       # counts per TRANSFER_BUCKETS_S bound, then above the last
    time_sum_s: float


@dataclass
class DisaggCounters:
    """Bytes and blocks moved, transfer times, and what went wrong, for one role."""

    role: str
    sent_bytes: int = 0
    sent_blocks: int = 0             # blocks whose last layer went out
    skipped_blocks: int = 0          # blocks the decode instance already held: not sent
    send_failures: int = 0           # transfers the prefill side could not deliver
    loads: int = 0                   # remote loads finished (decode)
    received_blocks: int = 0         # blocks loaded intact from a transfer or the shared tier
    recomputed_blocks: int = 0       # blocks a remote load lacked: computed by the decode side
    fallback_blocks: int = 0         # blocks taken from the shared tier after a transfer failed
    time_buckets: list[int] = field(default_factory=lambda: [0] * (len(TRANSFER_BUCKETS_S) + 1))
    time_sum_s: float = 0.0
    time_count: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def _observe(self, seconds: float) -> None:
        index = next((i for i, b in enumerate(TRANSFER_BUCKETS_S) if seconds <= b), len(TRANSFER_BUCKETS_S))
        self.time_buckets[index] += 1
        self.time_sum_s += seconds
        self.time_count += 1

    def note_sent(self, nbytes: int, blocks: int, seconds: float) -> None:
        """One layer frame went out (``blocks``: counted on the last layer only)."""
        with self._lock:
            self.sent_bytes += nbytes
            self.sent_blocks += blocks
            self._observe(seconds)

    def note_load(self, wanted: int, intact: int, seconds: float) -> None:
        """A remote load ended with ``intact`` of ``wanted`` blocks in the pool."""
        with self._lock:
            self.loads += 1
            self.received_blocks += intact
            self.recomputed_blocks += wanted - intact
            self._observe(seconds)

    def snapshot(self, received_bytes: int = 0, failed_transfers: int = 0) -> KVTransferStats:
        """The counters now, with the receiver's bytes and failed transfers (decode role)."""
        with self._lock:
            return KVTransferStats(self.role, self.sent_bytes, self.sent_blocks, self.skipped_blocks,
                                   self.send_failures, received_bytes, self.received_blocks,
                                   self.recomputed_blocks, self.fallback_blocks, failed_transfers,
                                   tuple(self.time_buckets), self.time_sum_s)
