"""Store keys and the record codec: round trips, and every corruption decodes to a miss."""

from __future__ import annotations

import numpy as np
import pytest

from kvhive.store.codec import MIN_HEADER_BYTES, decode_block, encode_block, encoded_len, read_header
from kvhive.store.key import KeySpace, StoreKey

SPACE = KeySpace("smollm2-135m@abc", 1, "float32", 16)


def _record(key: StoreKey, payload) -> bytes:
    return b"".join(bytes(part) for part in encode_block(key, payload))


def test_key_encoding_is_stable_and_distinguishes_every_field():
    key = SPACE.key(bytes(range(16)))
    assert key.encode() == b"kvh1:1:float32:16:smollm2-135m@abc:000102030405060708090a0b0c0d0e0f"
    assert key.encode() == SPACE.prefix + bytes(range(16)).hex().encode()
    variants = [
        StoreKey("other", 1, "float32", 16, key.block_hash),
        StoreKey(key.model_fingerprint, 2, "float32", 16, key.block_hash),
        StoreKey(key.model_fingerprint, 1, "bfloat16", 16, key.block_hash),
        StoreKey(key.model_fingerprint, 1, "float32", 32, key.block_hash),
        StoreKey(key.model_fingerprint, 1, "float32", 16, b"\x01" * 16),
    ]
    encodings = {v.encode() for v in variants} | {key.encode()}
    assert len(encodings) == len(variants) + 1
    assert SPACE.keys([b"\x00" * 16, b"\x01" * 16]) == [SPACE.key(b"\x00" * 16), SPACE.key(b"\x01" * 16)]


@pytest.mark.parametrize("bad", [
    dict(model_fingerprint=""), dict(layout_version=-1), dict(dtype="a:b"), dict(block_size=0),
    dict(block_hash=b"short"),
])
def test_key_rejects_bad_fields(bad):
    fields = dict(model_fingerprint="m", layout_version=1, dtype="float32", block_size=16,
                  block_hash=b"\x00" * 16)
    with pytest.raises(ValueError):
        StoreKey(**{**fields, **bad})


def test_round_trip_is_zero_copy_for_bytes_bytearray_and_numpy():
    key = SPACE.key(b"\x07" * 16)
    kv = np.random.default_rng(0).standard_normal((2, 3, 2, 16, 3, 8)).astype(np.float32)
    parts = encode_block(key, kv)
    assert parts[1].obj is kv                       # the payload part is a view, not a copy
    assert len(parts[0]) + parts[1].nbytes == encoded_len(key, kv.nbytes)
    record = _record(key, kv)
    payload = decode_block(record, key)
    assert payload is not None and payload.obj is record   # a view into the buffer
    np.testing.assert_array_equal(np.frombuffer(payload, dtype=np.float32).reshape(kv.shape), kv)
    assert bytes(decode_block(bytearray(record), key)) == kv.tobytes()
    assert bytes(decode_block(memoryview(record), key)) == kv.tobytes()
    empty = _record(key, b"")
    assert decode_block(empty, key) is not None and len(decode_block(empty, key)) == 0


def test_non_contiguous_payload_is_rejected():
    with pytest.raises(ValueError):
        encode_block(SPACE.key(b"\x00" * 16), np.zeros((4, 4), dtype=np.float32)[:, ::2])


def test_every_corruption_is_a_miss():
    key = SPACE.key(b"\x01" * 16)
    payload = np.arange(1000, dtype=np.float32).tobytes()
    record = _record(key, payload)
    header_len = read_header(record).header_len
    assert decode_block(record, key) is not None
    # Wrong name: the same bytes looked up under another key.
    assert decode_block(record, SPACE.key(b"\x02" * 16)) is None
    assert decode_block(record, StoreKey("other", 1, "float32", 16, key.block_hash)) is None
    # Truncated anywhere, or with bytes appended.
    for cut in (0, 3, MIN_HEADER_BYTES - 1, header_len - 1, header_len, len(record) - 1):
        assert decode_block(record[:cut], key) is None, cut
    assert decode_block(record + b"\x00", key) is None
    # Every single-byte flip in the header, and flips across the payload.
    positions = list(range(header_len)) + list(range(header_len, len(record), 97)) + [len(record) - 1]
    for pos in positions:
        flipped = bytearray(record)
        flipped[pos] ^= 0x40
        assert decode_block(flipped, key) is None, pos
    # Garbage of the right length, and a future format version with a valid header checksum.
    assert decode_block(bytes(len(record)), key) is None
    assert decode_block(np.random.default_rng(1).bytes(len(record)), key) is None
    future = bytearray(record)
    future[4] = 2
    assert decode_block(future, key) is None


def test_read_header_finds_records_at_offsets():
    key = SPACE.key(b"\x03" * 16)
    record = _record(key, b"x" * 100)
    buf = b"junk" + record
    header = read_header(buf, 4)
    assert header is not None and header.key == key.encode() and header.record_len == len(record)
    assert read_header(buf, 0) is None
    assert read_header(buf[:-100], 4) is not None                  # header alone is intact
    assert read_header(buf[: 4 + header.header_len - 1], 4) is None  # torn header
