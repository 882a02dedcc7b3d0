"""Segment files of the disk tier: naming, appending and reading records, scanning, recovery at
startup, and the index snapshot.

A segment is an append-only file of codec records (codec.py), each self-describing, so the
index (key -> segment, offset, length) can always be rebuilt by scanning headers. The snapshot
is only a shortcut for that scan, written on clean shutdown.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import msgpack
import xxhash

from kvhive.core.atomic_file import TEMP_SUFFIX, atomic_write
from kvhive.store.codec import MAGIC, read_header

SEGMENT_PREFIX = "seg-"
SEGMENT_SUFFIX = ".kvs"
SNAPSHOT_NAME = "index.snapshot"
_SNAPSHOT_VERSION = 1


class RecordLocation(NamedTuple):
    """Where one record lives: segment id, byte offset, record length (header + payload)."""

    segment: int
    offset: int
    length: int


class ScannedSegment(NamedTuple):
    """The intact records of one segment, in file order, and where the last of them ends."""

    records: list[tuple[bytes, int, int]]   # (encoded key, offset, record length)
    good_end: int


class Snapshot(NamedTuple):
    """An index written at clean shutdown: segment sizes then, and the live records."""

    segment_sizes: dict[int, int]
    records: dict[int, list[tuple[bytes, int, int]]]   # segment id -> (encoded key, offset, length)


@dataclass
class SegmentSpan:
    """One segment's place in the bytes appended to the store, and every key written to it."""

    start: int                                       # bytes appended to the store before this segment
    size: int                                        # bytes in the file, live or dead
    keys: list[bytes] = field(default_factory=list)  # every key written here; the index says which are live

    @property
    def end(self) -> int:
        """Bytes appended to the store up to the end of this segment."""
        return self.start + self.size


class RecoveredSegment(NamedTuple):
    """One segment as startup found it: its size, its intact records, the torn bytes cut off its end."""

    segment_id: int
    size: int
    records: list[tuple[bytes, int, int]]   # (encoded key, offset, record length), in file order
    num_torn_bytes: int = 0


def segment_path(directory: str, segment_id: int) -> str:
    """The file of segment ``segment_id``; ids only grow, so a path is never reused."""
    return os.path.join(directory, f"{SEGMENT_PREFIX}{segment_id:012d}{SEGMENT_SUFFIX}")


def list_segments(directory: str) -> list[int]:
    """Ids of the segment files in ``directory``, oldest first."""
    ids = []
    for name in os.listdir(directory):
        if name.startswith(SEGMENT_PREFIX) and name.endswith(SEGMENT_SUFFIX):
            digits = name[len(SEGMENT_PREFIX):-len(SEGMENT_SUFFIX)]
            if digits.isdigit():
                ids.append(int(digits))
    return sorted(ids)


def append_record(fd: int, buffers: Sequence[bytes | memoryview]) -> None:
    """Write all of ``buffers`` at the end of an O_APPEND file, looping over short writes."""
    views = [memoryview(b) for b in buffers]
    while views:
        written = os.writev(fd, views)
        while views and written >= views[0].nbytes:
            written -= views[0].nbytes
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


def scan_segment(path: str) -> ScannedSegment:
    """The records whose header checksum holds and whose bytes are all in the file.

    A corrupt header is skipped by searching for the next magic (the header checksum rejects
    false matches inside payloads), so one bad record never hides the records after it. Payload
    checksums are not read here; every get checks them.
    """
    size = os.path.getsize(path)
    if size == 0:
        return ScannedSegment([], 0)
    records: list[tuple[bytes, int, int]] = []
    good_end = offset = 0
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        while 0 <= offset < size:
            header = read_header(mm, offset)
            if header is not None and offset + header.record_len <= size:
                records.append((header.key, offset, header.record_len))
                offset += header.record_len
                good_end = offset
            else:
                offset = mm.find(MAGIC, offset + 1)
    return ScannedSegment(records, good_end)


def recover_segments(directory: str) -> list[RecoveredSegment]:
    """Every segment's size and records, oldest first: from the snapshot where it covers a segment
    at the size it recorded, else from a scan; the last segment's torn tail is truncated."""
    snapshot = take_snapshot(directory)
    ids = list_segments(directory)
    out = []
    for seg in ids:
        path = segment_path(directory, seg)
        size = os.path.getsize(path)
        if snapshot is not None and snapshot.segment_sizes.get(seg) == size:
            out.append(RecoveredSegment(seg, size, snapshot.records.get(seg, [])))
            continue
        scanned = scan_segment(path)
        torn = size - scanned.good_end if seg == ids[-1] else 0
        if torn > 0:
            os.truncate(path, scanned.good_end)
        out.append(RecoveredSegment(seg, size - torn, scanned.records, torn))
    return out


def read_record(directory: str, loc: RecordLocation) -> bytes | None:
    """The record's bytes; None if its segment is gone (OSError for a failed read)."""
    try:
        # A fresh fd per read: a concurrently dropped segment is then FileNotFoundError, never
        # bytes from a file that reused a cached descriptor number.
        fd = os.open(segment_path(directory, loc.segment), os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        return os.pread(fd, loc.length, loc.offset)
    finally:
        os.close(fd)


def fsync_directory(directory: str) -> None:
    """Make file creations, renames and unlinks in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_snapshot(directory: str, segment_sizes: dict[int, int],
                   index: dict[bytes, RecordLocation]) -> None:
    """Write the index atomically (temp file, fsync, rename; on failure the temp file is removed and
    the error raised); the checksum guards against bit rot."""
    body = msgpack.packb({
        "version": _SNAPSHOT_VERSION,
        "segments": [[seg, size] for seg, size in segment_sizes.items()],
        "records": [[key, loc.segment, loc.offset, loc.length] for key, loc in index.items()],
    })
    atomic_write(os.path.join(directory, SNAPSHOT_NAME), xxhash.xxh3_64_digest(body) + body)
    fsync_directory(directory)


def take_snapshot(directory: str) -> Snapshot | None:
    """Read and remove the snapshot; None when absent or damaged.

    Removing it on read keeps it true: after a crash there is no snapshot and the store scans. A
    temp file a crash left mid-write is removed too.
    """
    path = os.path.join(directory, SNAPSHOT_NAME)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path + TEMP_SUFFIX)
    try:
        with open(path, "rb") as f:
            raw = f.read()
        os.unlink(path)
    except FileNotFoundError:
        return None
    checksum, body = raw[:8], raw[8:]
    if len(raw) < 8 or xxhash.xxh3_64_digest(body) != checksum:
        return None
    try:
        data = msgpack.unpackb(body)
        if data["version"] != _SNAPSHOT_VERSION:
            return None
        records: dict[int, list[tuple[bytes, int, int]]] = {}
        for key, seg, offset, length in data["records"]:
            records.setdefault(seg, []).append((key, offset, length))
        return Snapshot({seg: size for seg, size in data["segments"]}, records)
    except (ValueError, KeyError, TypeError):
        return None
