"""DiskStore: the local-disk tier, blocks packed into append-only segment files under a byte budget.

Layout: ``seg-<id>.kvs`` files of codec records (header + payload, see codec.py), ids growing,
one active segment taking appends. The index (encoded key -> segment, offset, length) lives in
memory; it is rebuilt at startup from ``index.snapshot`` (written on clean close) or, for
segments the snapshot does not cover, by scanning record headers.

Crash safety: a record becomes visible in the index only after its write returned, and every
get checks the record's key and payload checksum, so a torn or corrupt record is a miss. A kill
mid-write leaves at worst a torn tail; the startup scan stops trusting the last segment where
its last intact record ends and truncates the rest.

fsync policy: a segment is fsynced when it is sealed (by the put that started the next one,
after releasing the lock, so other calls do not wait) and the active one on close. A killed
process loses nothing its writes returned (the page cache survives it); a power loss may lose
records not yet fsynced, which the scan and the checksums then drop.

Eviction is LRU by segment with reinsertion: when the store is over budget the oldest segment
is deleted whole (one unlink, no compaction). A block read (or put again) after more than half
a budget has been written since its segment ended is rewritten into the active segment, so a
dropped segment holds only blocks not used for that long. Below half the budget nothing is
rewritten (no write amplification while there is room). Deletes are not persisted: a deleted block
can come back after a restart, which is harmless because a key names its content.

A full filesystem (ENOSPC, EDQUOT: other files took the room the budget counted on): the partial
record is cut off, the oldest segments holding no live pinned record are deleted one by one and the
write retried; when none is left the block is refused (a miss later). Failed writes are counted
(``StoreStats.write_errors``) and logged once per ``failure_log_interval_s`` with a count.

Startup removes what a crash can leave besides a torn tail: the snapshot's temp file.

Pins: a pinned key's record is never dropped. Before a segment is deleted, its live pinned records
are copied into the active segment; a put that would not fit beside the pinned records is
refused instead. Pins live in memory only: the owner (the session registry) pins again after a
restart.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence

from kvhive.core.failure_log import DEFAULT_INTERVAL_S, FailureLog
from kvhive.store.base import Payload, PutResult, StatsCounter, StoreStats
from kvhive.store.codec import decode_block, encode_block
from kvhive.store.disk_index import DiskIndex
from kvhive.store.key import StoreKey
from kvhive.store.segment import (
    RecordLocation,
    SegmentSpan,
    append_record,
    fsync_directory,
    read_record,
    recover_segments,
    segment_path,
    write_snapshot,
)

logger = logging.getLogger(__name__)
DEFAULT_SEGMENT_BYTES = 64 * 1024 * 1024
# The errors of a filesystem with no room left for this process: dropping segments makes room.
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


class DiskStore:
    """Blocks in append-only segment files with a persistent index; LRU by segment under a byte budget."""

    def __init__(self, directory: str, budget_bytes: int, segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                 failure_log_interval_s: float = DEFAULT_INTERVAL_S) -> None:
        if budget_bytes <= 0 or segment_bytes <= 0:
            raise ValueError(f"disk tier budget and segment size must be > 0, "
                             f"got {budget_bytes}, {segment_bytes}")
        self.directory = directory
        self.budget_bytes = budget_bytes
        # At least four segments fit the budget, so dropping one never empties the tier.
        self.segment_bytes = max(1, min(segment_bytes, budget_bytes // 4))
        self._lock = threading.Lock()
        self._stats = StatsCounter()
        self._write_failures = FailureLog(logger, "disk tier: writes failed", failure_log_interval_s)
        # Invariants: _segments is ordered oldest -> newest and its last entry is the active segment;
        # every index entry points into a segment in _segments; used bytes == sum of segment sizes.
        self._segments: dict[int, SegmentSpan] = {}
        self._index = DiskIndex()
        self._used_bytes = 0
        self._sealed_fds: list[int] = []             # sealed by rotation, waiting for fsync + close
        os.makedirs(directory, exist_ok=True)
        self._load()
        self._active_fd = os.open(segment_path(directory, self._active_id),
                                  os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    @property
    def _active_id(self) -> int:
        return next(reversed(self._segments))

    # ------------------------------------------------------------------ startup

    def _load(self) -> None:
        """Rebuild the index from the snapshot and segment scans; truncate a torn tail."""
        recovered = recover_segments(self.directory)
        for seg, size, records, num_torn in recovered:
            if num_torn:
                logger.warning("disk tier: dropping %d torn bytes at the end of %s", num_torn,
                               segment_path(self.directory, seg))
            segment = self._segments[seg] = SegmentSpan(self._used_bytes, size)
            self._used_bytes += size
            for key, offset, length in records:   # later segments overwrite: the newest copy wins
                self._index.set(key, RecordLocation(seg, offset, length))
                segment.keys.append(key)
        if not self._segments or self._segments[self._active_id].size >= self.segment_bytes:
            self._segments[(recovered[-1].segment_id + 1) if recovered else 1] = SegmentSpan(self._used_bytes, 0)
        self._evict_to_fit(0)

    # ------------------------------------------------------------------ the BlockStore calls

    def contains(self, keys: Sequence[StoreKey]) -> list[bool]:
        """Whether each key has an indexed record; recency is unchanged."""
        encoded = [key.encode() for key in keys]
        with self._lock:
            return [k in self._index for k in encoded]

    def get(self, key: StoreKey) -> memoryview | None:
        """The payload (one pread, key and checksum checked); a hit due for eviction is rewritten forward."""
        start = time.perf_counter()
        encoded = key.encode()
        with self._lock:
            loc = self._index.get(encoded)
        payload = None
        record = None if loc is None else self._read(loc)
        if record is not None:
            payload = decode_block(record, key)
            if payload is None:
                logger.warning("disk tier: corrupt record in segment %d at offset %d is a miss",
                               loc.segment, loc.offset)
                self._forget(encoded, loc)
                self._stats.record_error()
            else:
                with self._lock:
                    if self._index.get(encoded) == loc and self._is_old(loc.segment):
                        self._append(encoded, [record])
                self._sync_sealed()
        self._stats.record_get(None if payload is None else payload.nbytes, time.perf_counter() - start)
        return payload

    def put(self, key: StoreKey, payload: Payload) -> PutResult:
        """Append the block unless it is already stored in a recent segment; False if it cannot fit."""
        encoded = key.encode()
        buffers = encode_block(key, payload)   # checksums computed outside the lock
        record_len = sum(memoryview(b).nbytes for b in buffers)
        if record_len > self.segment_bytes:
            return PutResult(False)
        with self._lock:
            loc = self._index.get(encoded)
            if loc is not None and not self._is_old(loc.segment):
                return PutResult(True)
            stored = self._append(encoded, buffers)
        self._sync_sealed()
        if stored:
            self._stats.record_put(memoryview(buffers[1]).nbytes)
        return PutResult(stored)

    def delete(self, key: StoreKey) -> None:
        """Drop the block from the index (not persisted: see the module docstring)."""
        with self._lock:
            self._index.pop(key.encode())

    def pin(self, keys: Iterable[StoreKey]) -> None:
        """Never drop these keys' records, stored now or later, until ``unpin``."""
        with self._lock:
            self._index.pin(key.encode() for key in keys)

    def unpin(self, keys: Iterable[StoreKey]) -> None:
        """Let these keys' records go with their segments again."""
        with self._lock:
            self._index.unpin(key.encode() for key in keys)

    def track_drops(self) -> None:
        """Keep the block hashes of records that leave the index from now on, for ``take_dropped``."""
        with self._lock:
            self._index.track_drops()

    def take_dropped(self) -> list[bytes]:
        """Block hashes of the records dropped (segment deleted, corrupt, deleted) since the last call."""
        with self._lock:
            return self._index.take_dropped()

    def held_hashes(self, prefix: bytes) -> list[bytes]:
        """Block hashes of the indexed records whose encoded key starts with ``prefix`` (a key space)."""
        with self._lock:
            return self._index.held_hashes(prefix)

    def drop_unpinned(self) -> int:
        """Forget every record no pin keeps and delete the sealed segments left with no live record;
        returns how many records were forgotten (a crash before the next clean close may bring them
        back, as for ``delete``)."""
        with self._lock:
            num_gone = self._index.forget_unpinned()
            live = self._index.live_segments()
            for seg in list(self._segments)[:-1]:
                if seg not in live:
                    self._used_bytes -= self._segments.pop(seg).size
                    try:
                        os.unlink(segment_path(self.directory, seg))
                    except OSError as exc:   # the index no longer points there: at worst disk space leaks
                        logger.warning("disk tier: cannot delete segment %d: %s", seg, exc)
        return num_gone

    def stats(self) -> StoreStats:
        """Counters, bytes in segment files and the budget."""
        with self._lock:
            used = self._used_bytes
        return self._stats.snapshot(used, self.budget_bytes)

    def close(self) -> None:
        """fsync the active segment and write the index snapshot for a fast next start (when that
        fails, e.g. on a full filesystem, the next start scans the segments instead)."""
        self._sync_sealed()
        with self._lock:
            if self._active_fd < 0:
                return
            fd, self._active_fd = self._active_fd, -1
            try:
                os.fsync(fd)
                write_snapshot(self.directory, {seg: s.size for seg, s in self._segments.items()}, self._index.locations)
            except OSError as exc:
                logger.warning("disk tier: no index snapshot written (the next start scans): %s", exc)
            finally:
                os.close(fd)

    # ------------------------------------------------------------------ internals

    def _read(self, loc: RecordLocation) -> bytes | None:
        """The record's bytes; None if its segment was dropped meanwhile (a miss) or the read failed."""
        try:
            return read_record(self.directory, loc)
        except OSError as exc:
            logger.warning("disk tier: read failed: %s", exc)
            self._stats.record_error()
            return None

    def _forget(self, encoded: bytes, loc: RecordLocation) -> None:
        """Drop an index entry found unreadable, unless it was rewritten meanwhile."""
        with self._lock:
            if self._index.get(encoded) == loc:
                self._index.pop(encoded)

    def _is_old(self, seg: int) -> bool:
        """Whether more than half a budget was written after ``seg`` (it is due to be dropped); lock held."""
        written_since = self._segments[self._active_id].end - self._segments[seg].end
        return written_since > self.budget_bytes // 2

    def _append(self, encoded: bytes, buffers: list[bytes | memoryview]) -> bool:
        """Make room for one record, write it at the end of the active segment and index it; lock held."""
        record_len = sum(memoryview(b).nbytes for b in buffers)
        if self._active_fd < 0 or not self._evict_to_fit(record_len):
            return False
        return self._write(encoded, buffers, record_len)

    def _write(self, encoded: bytes, buffers: list[bytes | memoryview], record_len: int) -> bool:
        """Write one record at the end of the active segment (a new one if it is full) and index it;
        on a full filesystem drop the oldest unpinned segments and retry; False when refused. Lock held."""
        while True:
            error = self._try_write(encoded, buffers, record_len)
            if error is None:
                return True
            if error.errno not in FULL_ERRNOS or not self._drop_oldest_unpinned():
                self._stats.record_write_error()
                self._write_failures.record(error)
                return False

    def _try_write(self, encoded: bytes, buffers: list[bytes | memoryview], record_len: int) -> OSError | None:
        """One attempt of ``_write``: the error, or None once the record is written and indexed."""
        if self._segments[self._active_id].size + record_len > self.segment_bytes:
            try:
                self._rotate()
            except OSError as exc:
                return exc
        active = self._segments[self._active_id]
        offset = active.size
        try:
            append_record(self._active_fd, buffers)
        except OSError as exc:
            self._cut_torn_tail(active, offset)
            return exc
        active.size += record_len
        self._used_bytes += record_len
        active.keys.append(encoded)
        self._index.set(encoded, RecordLocation(self._active_id, offset, record_len))
        return None

    def _cut_torn_tail(self, active: SegmentSpan, offset: int) -> None:
        """Cut a partial record off the active segment; if that fails, count what stayed so offsets
        remain true (the torn record is never indexed, and its payload checksum makes it a miss
        if a startup scan finds its header). Lock held."""
        try:
            os.ftruncate(self._active_fd, offset)
        except OSError:
            grown = os.fstat(self._active_fd).st_size - offset
            active.size += grown
            self._used_bytes += grown

    def _drop_oldest_unpinned(self) -> bool:
        """Delete the oldest segment that holds no live pinned record, to make room on a full
        filesystem; the active one is sealed first when it is the only candidate. False when no
        segment can go. Lock held."""
        pinned = self._index.pinned_segments()
        candidates = [seg for seg, segment in self._segments.items() if seg not in pinned and segment.size]
        if not candidates:
            return False
        if candidates[0] == self._active_id:
            try:
                self._rotate()
            except OSError:
                return False
        self._drop_segment(candidates[0])
        return True

    def _rotate(self) -> None:
        """Seal the active segment (queued for fsync) and start the next one; lock held."""
        new_id = self._active_id + 1
        new_fd = os.open(segment_path(self.directory, new_id), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._sealed_fds.append(self._active_fd)
        self._segments[new_id] = SegmentSpan(self._segments[self._active_id].end, 0)
        self._active_fd = new_fd

    def _sync_sealed(self) -> None:
        """fsync and close the segments sealed since the last call, and the directory; lock not held."""
        with self._lock:
            fds, self._sealed_fds = self._sealed_fds, []
        try:
            for fd in fds:
                os.fsync(fd)
            if fds:
                fsync_directory(self.directory)
        except OSError as exc:
            self._stats.record_write_error()
            self._write_failures.record(exc)
        finally:
            for fd in fds:
                os.close(fd)

    def _evict_to_fit(self, record_len: int) -> bool:
        """Delete the oldest sealed segments until ``record_len`` more bytes fit the budget; lock held.

        Live pinned records of a deleted segment are copied forward first. False when the record
        does not fit beside the pinned ones (nothing is deleted then) or still does not fit.
        """
        if self._used_bytes + record_len <= self.budget_bytes:
            return True
        if self._index.pinned_bytes + record_len > self.budget_bytes:
            return False
        # One pass over the segments sealed now: copies land in newer segments, never in these. A
        # segment whose pinned records cannot all be copied (a full filesystem) stays; a copy that
        # made room on a full filesystem may have dropped a later one of these already.
        for seg in list(self._segments)[:-1]:
            if self._used_bytes + record_len <= self.budget_bytes:
                break
            if seg in self._segments and self._carry_pinned_forward(seg) and seg in self._segments:
                self._drop_segment(seg)
        return self._used_bytes + record_len <= self.budget_bytes

    def _drop_segment(self, seg: int) -> None:
        """Delete a sealed segment and forget the records it holds live; lock held."""
        segment = self._segments.pop(seg)
        self._used_bytes -= segment.size
        dropped = 0
        for key in segment.keys:
            loc = self._index.get(key)
            if loc is not None and loc.segment == seg:
                self._index.pop(key)
                dropped += 1
        try:
            os.unlink(segment_path(self.directory, seg))
        except OSError as exc:   # the index no longer points there: at worst disk space leaks
            logger.warning("disk tier: cannot delete segment %d: %s", seg, exc)
        self._stats.record_evictions(dropped)

    def _carry_pinned_forward(self, seg: int) -> bool:
        """Copy the live pinned records of ``seg`` to the end of the active segment; False when one
        could not be copied (the segment must then stay). Lock held."""
        kept = True
        for key in self._segments[seg].keys:
            loc = self._index.get(key)
            if not self._index.is_pinned(key) or loc is None or loc.segment != seg:
                continue
            record = self._read(loc)
            if record is not None and not self._write(key, [record], loc.length):
                kept = False
        return kept
