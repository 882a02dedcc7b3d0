"""Store objects as bytes: one record = a small header + the block's payload, no pickle.

Record layout (little-endian):

    offset  size  field
    0       4     magic b"KVHB"
    4       2     format version (1)
    6       2     header length = 32 + key length
    8       8     payload length
    16      8     xxh3-64 of the payload
    24      k     the encoded StoreKey (StoreKey.encode())
    24+k    8     xxh3-64 of header bytes [0, 24+k)
    32+k    n     payload

The header checksum lets a scanner trust a record's lengths before reading its payload (the disk
tier rebuilds its index from headers alone); the payload checksum is checked on every decode. A
buffer that is not exactly one valid record under the expected key decodes to None: a miss,
never wrong KV.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from kvhive.store.base import Payload
from kvhive.store.key import StoreKey

MAGIC = b"KVHB"
FORMAT_VERSION = 1
_FIXED = struct.Struct("<4sHHQQ")       # magic, version, header length, payload length, payload checksum
_CHECKSUM = struct.Struct("<Q")
MIN_HEADER_BYTES = _FIXED.size + _CHECKSUM.size
MAX_HEADER_BYTES = 4096                  # keys are short; anything longer is a corrupt length field


@dataclass(frozen=True)
class RecordHeader:
    """A record header that passed its own checksum (the payload is not checked yet)."""

    key: bytes              # the encoded StoreKey
    header_len: int
    payload_len: int
    payload_checksum: int

    @property
    def record_len(self) -> int:
        """Header plus payload, in bytes."""
        return self.header_len + self.payload_len


def as_bytes_view(payload: Payload) -> memoryview:
    """A flat unsigned-byte view of any C-contiguous buffer (bytes, bytearray, numpy array), no copy."""
    view = memoryview(payload)
    if not view.c_contiguous:
        raise ValueError("store payload must be a C-contiguous buffer")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def encode_block(key: StoreKey, payload: Payload) -> list[bytes | memoryview]:
    """[header, payload view]: write both with writev / join once; the payload itself is not copied."""
    data = as_bytes_view(payload)
    encoded_key = key.encode()
    fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, MIN_HEADER_BYTES + len(encoded_key), data.nbytes,
                        xxhash.xxh3_64_intdigest(data))
    head = fixed + encoded_key
    return [head + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(head)), data]


def encoded_len(key: StoreKey, payload_len: int) -> int:
    """The length of the record that encode_block makes for this key and payload length."""
    return MIN_HEADER_BYTES + len(key.encode()) + payload_len


def read_header(buf: bytes | memoryview, offset: int = 0) -> RecordHeader | None:
    """The header of the record at ``offset`` in ``buf``, or None when it is torn or corrupt."""
    if offset + MIN_HEADER_BYTES > len(buf):
        return None
    magic, version, header_len, payload_len, payload_checksum = _FIXED.unpack_from(buf, offset)
    if magic != MAGIC or version != FORMAT_VERSION:
        return None
    if not MIN_HEADER_BYTES <= header_len <= MAX_HEADER_BYTES or offset + header_len > len(buf):
        return None
    body_end = offset + header_len - _CHECKSUM.size
    (header_checksum,) = _CHECKSUM.unpack_from(buf, body_end)
    if xxhash.xxh3_64_intdigest(memoryview(buf)[offset:body_end]) != header_checksum:
        return None
    key = bytes(buf[offset + _FIXED.size: body_end])
    return RecordHeader(key, header_len, payload_len, payload_checksum)


def decode_block(buf: Payload, expected_key: StoreKey) -> memoryview | None:
    """The payload of a record (a view into ``buf``, no copy), or None on any mismatch or corruption."""
    view = as_bytes_view(buf)
    header = read_header(view)
    if header is None or header.key != expected_key.encode() or header.record_len != len(view):
        return None
    payload = view[header.header_len:]
    if xxhash.xxh3_64_intdigest(payload) != header.payload_checksum:
        return None
    return payload
