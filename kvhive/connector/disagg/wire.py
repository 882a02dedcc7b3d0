"""Framing of the prefill-to-decode channel: every frame and every block is checked.

A frame on the byte stream (little-endian):

    u32 header length n (<= MAX_HEADER_BYTES) | n bytes msgpack header | u64 xxh3-64 of the header
    | body (header["body_len"] bytes, <= MAX_BODY_BYTES)

A ``layer`` frame's body is one store record per block (``kvhive.store.codec``: the block's key,
that is model fingerprint, layout version, dtype, block size and block hash, then the block's K
and V of that one layer, with its checksum). The receiver decodes each record under the key it
expects, so another model's KV, a corrupt byte or a short read is detected exactly as a corrupt
store object is: the transfer fails and the decode side recomputes, never decodes from it.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

import msgpack
import xxhash

from kvhive.store.codec import decode_block, encode_block, read_header
from kvhive.store.key import StoreKey

MAX_HEADER_BYTES = 1 << 20      # a hello lists up to MAX_BLOCKS hashes
MAX_BODY_BYTES = 1 << 30
MAX_BLOCKS = 16384
_LEN = struct.Struct("<I")
_SUM = struct.Struct("<Q")
_WAITALL = getattr(socket, "MSG_WAITALL", 0)


class WireError(ConnectionError):
    """The stream ended early, or a frame or a block failed its checks."""


def send_frame(sock: socket.socket, header: dict[str, Any], body: list[bytes | memoryview] = ()) -> None:
    """Write one frame: ``header`` (msgpack-able; body_len is filled in) and the ``body`` parts."""
    header = {**header, "body_len": sum(memoryview(p).nbytes for p in body)}
    packed = msgpack.packb(header, use_bin_type=True)
    sock.sendall(_LEN.pack(len(packed)) + packed + _SUM.pack(xxhash.xxh3_64_intdigest(packed)))
    for part in body:
        sock.sendall(part)


def blocking_with_deadline(sock: socket.socket, timeout_s: float) -> None:
    """Make ``sock`` blocking with a kernel receive/send deadline of ``timeout_s``, so a whole
    frame body arrives in one ``MSG_WAITALL`` call (one wake-up, the GIL released throughout,
    instead of one per segment); a socket the kernel refuses the deadline for keeps Python's."""
    seconds = int(timeout_s)
    micros = int((timeout_s - seconds) * 1e6) if seconds else max(int(timeout_s * 1e6), 1)   # 0 is "never"
    timeval = struct.pack("ll", seconds, micros)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
    except (OSError, AttributeError):
        sock.settimeout(timeout_s)
        return
    sock.settimeout(None)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    """Exactly ``n`` bytes, or WireError when the stream ends first (OSError past a deadline)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    flags = _WAITALL if sock.gettimeout() is None else 0
    while got < n:
        k = sock.recv_into(view[got:], n - got, flags)
        if k == 0:
            raise WireError(f"the stream ended after {got} of {n} bytes")
        got += k
    return buf


def recv_frame(sock: socket.socket) -> tuple[dict[str, Any], bytearray]:
    """Read one frame: (header, body); WireError when truncated, oversized or corrupt."""
    (length,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if not 0 < length <= MAX_HEADER_BYTES:
        raise WireError(f"frame header of {length} bytes")
    packed = bytes(_recv_exact(sock, length))
    (checksum,) = _SUM.unpack(_recv_exact(sock, _SUM.size))
    if xxhash.xxh3_64_intdigest(packed) != checksum:
        raise WireError("frame header checksum mismatch")
    try:
        header = msgpack.unpackb(packed, raw=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise WireError(f"frame header is not msgpack: {exc}") from None
    body_len = header.get("body_len") if isinstance(header, dict) else None
    if not isinstance(body_len, int) or not 0 <= body_len <= MAX_BODY_BYTES:
        raise WireError("frame header without a valid body_len")
    return header, _recv_exact(sock, body_len) if body_len else bytearray()


def encode_layer(keys: list[StoreKey], blocks: list[memoryview]) -> list[bytes | memoryview]:
    """The body of a ``layer`` frame: one record per block (``keys[i]`` names ``blocks[i]``)."""
    body: list[bytes | memoryview] = []
    for key, block in zip(keys, blocks, strict=True):
        body += encode_block(key, block)
    return body


def decode_layer(body: bytearray, keys: list[StoreKey]) -> list[memoryview]:
    """The blocks of a ``layer`` body, each checked under ``keys[i]``; WireError on any mismatch."""
    view, offset, out = memoryview(body), 0, []
    for key in keys:
        header = read_header(view, offset)
        if header is None or offset + header.record_len > len(view):
            raise WireError(f"block record {len(out)} is torn or corrupt")
        payload = decode_block(view[offset:offset + header.record_len], key)
        if payload is None:
            raise WireError(f"block record {len(out)} does not match its key (another model's KV, "
                            "or corrupt)")
        out.append(payload)
        offset += header.record_len
    if offset != len(view):
        raise WireError("layer frame carries bytes after its blocks")
    return out
