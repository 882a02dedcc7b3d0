"""The disk tier's record index: encoded key -> where its record lives, with pins and drops.

In memory only (rebuilt at startup from the snapshot and segment scans, see ``kvhive.store.disk``).
Pins name encoded keys whether or not they are indexed; ``pinned_bytes`` is the sum of the record
lengths of the indexed pinned ones. Not thread-safe: the disk tier's lock guards every call.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from kvhive.store.key import HASH_BYTES
from kvhive.store.segment import RecordLocation


class DiskIndex:
    """Encoded key -> ``RecordLocation``; pinned keys and their bytes; hashes of records that left."""

    def __init__(self) -> None:
        self.locations: dict[bytes, RecordLocation] = {}
        # Pinned encoded keys, held or not; pinned_bytes == sum of record lengths of the indexed ones.
        self._pins: set[bytes] = set()
        self.pinned_bytes = 0
        self._dropped: list[bytes] | None = None     # hashes of records dropped since take_dropped

    def __contains__(self, encoded: bytes) -> bool:
        return encoded in self.locations

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.locations)

    def get(self, encoded: bytes) -> RecordLocation | None:
        """Where the key's record lives, or None."""
        return self.locations.get(encoded)

    def set(self, encoded: bytes, loc: RecordLocation) -> None:
        """Index (or move) a key's record; keeps ``pinned_bytes`` true."""
        if encoded in self._pins:
            old = self.locations.get(encoded)
            self.pinned_bytes += loc.length - (old.length if old is not None else 0)
        self.locations[encoded] = loc

    def pop(self, encoded: bytes) -> None:
        """Drop a key's entry, recording its block hash for ``take_dropped``; keeps ``pinned_bytes`` true."""
        loc = self.locations.pop(encoded, None)
        if loc is not None and encoded in self._pins:
            self.pinned_bytes -= loc.length
        if loc is not None and self._dropped is not None:
            self._dropped.append(bytes.fromhex(encoded[-2 * HASH_BYTES:].decode()))

    def is_pinned(self, encoded: bytes) -> bool:
        """Whether the key is pinned (indexed or not)."""
        return encoded in self._pins

    def pin(self, encoded_keys: Iterable[bytes]) -> None:
        """Pin these keys, indexed now or later."""
        for encoded in encoded_keys:
            if encoded not in self._pins:
                self._pins.add(encoded)
                loc = self.locations.get(encoded)
                self.pinned_bytes += loc.length if loc is not None else 0

    def unpin(self, encoded_keys: Iterable[bytes]) -> None:
        """Unpin these keys."""
        for encoded in encoded_keys:
            if encoded in self._pins:
                self._pins.discard(encoded)
                loc = self.locations.get(encoded)
                self.pinned_bytes -= loc.length if loc is not None else 0

    def pinned_segments(self) -> set[int]:
        """Segments holding the live record of a pinned key."""
        return {self.locations[key].segment for key in self._pins if key in self.locations}

    def forget_unpinned(self) -> int:
        """Forget every entry no pin keeps (not recorded as dropped); returns how many."""
        gone = [key for key in self.locations if key not in self._pins]
        for key in gone:
            del self.locations[key]
        return len(gone)

    def live_segments(self) -> set[int]:
        """Segments holding at least one indexed record."""
        return {loc.segment for loc in self.locations.values()}

    def track_drops(self) -> None:
        """Record the block hashes of entries that leave from now on."""
        if self._dropped is None:
            self._dropped = []

    def take_dropped(self) -> list[bytes]:
        """Block hashes of the entries dropped since the last call."""
        dropped = self._dropped or []
        if self._dropped:
            self._dropped = []
        return dropped

    def held_hashes(self, prefix: bytes) -> list[bytes]:
        """Block hashes of the indexed keys that start with ``prefix`` (a key space)."""
        return [bytes.fromhex(k[len(prefix):].decode()) for k in self.locations if k.startswith(prefix)]
