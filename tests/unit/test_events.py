"""KV events: both vLLM encodings, an independent decoder over a real ZMQ socket, sequence, replay."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from kvhive.core.kv_events import (
    END_OF_REPLAY,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    encode_batch,
    normalize_medium,
)
from kvhive.kv.event_publisher import KVEventPublisher

# vLLM's documented schema (vllm/distributed/kv_events.py), field order as declared there.
VLLM_FIELDS = {
    "BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name", "extra_keys"],
    "BlockRemoved": ["block_hashes", "medium"],
    "AllBlocksCleared": [],
}


def independent_decode(payload: bytes) -> dict:
    """A decoder written from vLLM's schema only: plain msgpack, array (array_like) or map form."""
    body = msgpack.unpackb(payload, raw=False)
    if isinstance(body, list):
        out = {"ts": body[0], "events": [], "data_parallel_rank": body[2] if len(body) > 2 else None}
        for event in body[1]:
            tag, values = event[0], event[1:]
            out["events"].append({"type": tag, **dict(zip(VLLM_FIELDS[tag], values, strict=False))})
        return out
    return {"ts": body["ts"], "data_parallel_rank": body.get("data_parallel_rank"),
            "events": [dict(e) for e in body["events"]]}


def sample_batch() -> EventBatch:
    return EventBatch(
        ts=1234.5,
        events=[
            BlockStored([b"\x01" * 16, b"\x02" * 16], None, list(range(32)), 16, None, "GPU"),
            BlockStored([2**63 + 5], 77, list(range(16)), 16, 3, "CPU", "adapter-a"),
            BlockRemoved([b"\x01" * 16], "GPU"),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )


@pytest.mark.parametrize("as_map", [False, True])
def test_encode_decode_round_trip(as_map: bool) -> None:
    batch = sample_batch()
    assert decode_batch(encode_batch(batch, as_map=as_map)) == batch


def test_array_encoding_is_vllm_positional() -> None:
    body = msgpack.unpackb(encode_batch(sample_batch(), as_map=False), raw=False)
    assert body[0] == 1234.5 and body[2] == 0
    stored = body[1][0]
    assert stored[0] == "BlockStored"
    assert stored[1:7] == [[b"\x01" * 16, b"\x02" * 16], None, list(range(32)), 16, None, "GPU"]
    assert body[1][2] == ["BlockRemoved", [b"\x01" * 16], "GPU"]
    assert body[1][3] == ["AllBlocksCleared"]


def test_map_encoding_has_type_tags_and_names() -> None:
    body = msgpack.unpackb(encode_batch(sample_batch(), as_map=True), raw=False)
    assert body["ts"] == 1234.5 and body["data_parallel_rank"] == 0
    assert body["events"][1] == {"type": "BlockStored", "block_hashes": [2**63 + 5], "parent_block_hash": 77,
                                 "token_ids": list(range(16)), "block_size": 16, "lora_id": 3,
                                 "medium": "CPU", "lora_name": "adapter-a"}
    assert body["events"][3] == {"type": "AllBlocksCleared"}


def test_map_encoding_is_the_default_and_int_hashes_keep_the_low_64_bits() -> None:
    digest = bytes(range(16))
    batch = EventBatch(1.0, [BlockStored([digest], digest, [1] * 16, 16), BlockRemoved([digest])], 0)
    body = msgpack.unpackb(encode_batch(batch, int_hashes=True), raw=False)
    low = int.from_bytes(digest[8:], "big")
    assert body["events"][0]["block_hashes"] == [low] and body["events"][0]["parent_block_hash"] == low
    assert body["events"][1] == {"type": "BlockRemoved", "block_hashes": [low], "medium": "GPU"}
    assert low == int.from_bytes(digest, "big") & (2**64 - 1)


def test_decode_accepts_what_other_vllm_versions_send() -> None:
    old_array = msgpack.packb([5.0, [["BlockStored", [1, 2], None, list(range(32)), 16, None, None],
                                     ["BlockRemoved", [1], None]]])
    batch = decode_batch(old_array)
    assert batch.events == [BlockStored([1, 2], None, list(range(32)), 16, None, None),
                            BlockRemoved([1], None)]
    assert batch.data_parallel_rank is None
    newer_map = msgpack.packb({"ts": 6.0, "data_parallel_rank": 1, "events": [
        {"type": "BlockStored", "block_hashes": [b"h" * 8], "parent_block_hash": None, "token_ids": [1] * 16,
         "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None,
         "extra_keys": [None], "group_idx": 0, "kv_cache_spec_kind": "full_attention"},
        {"type": "SomethingNew", "x": 1},
        {"type": "BlockRemoved", "block_hashes": [b"h" * 8], "medium": "GPU", "group_idx": 0}]})
    batch = decode_batch(newer_map)
    assert [type(e).__name__ for e in batch.events] == ["BlockStored", "BlockRemoved"]
    assert batch.data_parallel_rank == 1
    longer_array = msgpack.packb([7.0, [["BlockRemoved", [3], "CPU", 0, "later-field"]], 0])
    assert decode_batch(longer_array).events == [BlockRemoved([3], "CPU")]


@pytest.mark.parametrize("payload", [b"\xc1", msgpack.packb("text"), msgpack.packb([1.0]),
                                     msgpack.packb([1.0, [["BlockStored", [1]]]]),
                                     msgpack.packb({"ts": "x", "events": []}),
                                     msgpack.packb([1.0, [["BlockRemoved", 5]]]),
                                     msgpack.packb([1.0, [7]])])
def test_decode_rejects_malformed_payloads(payload: bytes) -> None:
    with pytest.raises(ValueError):
        decode_batch(payload)


def test_normalize_medium() -> None:
    assert [normalize_medium(m) for m in (None, "gpu", "CPU", "Disk", "REMOTE", "lmcache")] == \
        ["GPU", "GPU", "CPU", "DISK", "REMOTE", "REMOTE"]


def _subscribe(ctx: zmq.Context, endpoint: str, topic: bytes) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    return sub


def _wait_connected(publisher: KVEventPublisher, sub: zmq.Socket) -> None:
    """PUB drops messages until the subscription arrives: publish probes until one gets through."""
    for _ in range(100):
        publisher.publish_cleared()
        if sub.poll(50):
            while sub.poll(100):
                sub.recv_multipart()
            return
    raise AssertionError("subscriber never connected")


@pytest.mark.parametrize("as_map", [False, True])
def test_publisher_frames_decode_with_independent_decoder(as_map: bool) -> None:
    publisher = KVEventPublisher("tcp://127.0.0.1:*", topic=b"kv-events", as_map=as_map)
    ctx = zmq.Context()
    sub = _subscribe(ctx, publisher.endpoint, b"kv-events")
    try:
        _wait_connected(publisher, sub)
        publisher.publish_stored([b"\xaa" * 16, b"\xbb" * 16], None, list(range(32)), 16, medium="GPU")
        publisher.publish_removed([b"\xaa" * 16], medium="CPU")
        frames = [sub.recv_multipart() for _ in range(2)]
    finally:
        publisher.close()
        sub.close(linger=0)
        ctx.term()
    topics = [f[0] for f in frames]
    seqs = [int.from_bytes(f[1], "big") for f in frames]
    assert topics == [b"kv-events"] * 2
    assert all(len(f[1]) == 8 for f in frames)
    assert seqs[1] == seqs[0] + 1
    first, second = (independent_decode(f[2]) for f in frames)
    assert first["events"] == [{"type": "BlockStored", "block_hashes": [b"\xaa" * 16, b"\xbb" * 16],
                                "parent_block_hash": None, "token_ids": list(range(32)), "block_size": 16,
                                "lora_id": None, "medium": "GPU", "lora_name": None,
                                **({} if as_map else {"extra_keys": None})}]
    assert second["events"] == [{"type": "BlockRemoved", "block_hashes": [b"\xaa" * 16], "medium": "CPU"}]
    assert abs(first["ts"] - time.time()) < 60


def _replay(ctx: zmq.Context, endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """vLLM's replay protocol from the client side: [b"", start] in, [b"", seq, payload]... out."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    try:
        while True:
            assert dealer.poll(5000), "replay did not answer"
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == END_OF_REPLAY:
                assert payload == b""
                return out
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(linger=0)


def test_sequence_numbers_and_replay_over_router_socket() -> None:
    publisher = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=5)
    ctx = zmq.Context()
    try:
        for i in range(8):
            publisher.publish_removed([i])
        deadline = time.monotonic() + 5
        replayed: list[tuple[int, bytes]] = []
        while time.monotonic() < deadline:
            replayed = _replay(ctx, publisher.replay_endpoint, 0)
            if replayed and replayed[-1][0] == 7:
                break
            time.sleep(0.05)
        # Only the last buffer_steps batches are kept; sequence numbers count every batch sent.
        assert [seq for seq, _ in replayed] == [3, 4, 5, 6, 7]
        assert [independent_decode(p)["events"][0]["block_hashes"] for _, p in replayed] == \
            [[3], [4], [5], [6], [7]]
        assert [seq for seq, _ in _replay(ctx, publisher.replay_endpoint, 6)] == [6, 7]
        assert _replay(ctx, publisher.replay_endpoint, 100) == []
    finally:
        publisher.close()
        ctx.term()


def test_publish_is_cheap_and_close_flushes() -> None:
    publisher = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    start = time.perf_counter()
    for i in range(2000):
        publisher.publish_removed([i])
    assert time.perf_counter() - start < 1.0
    replay = publisher.replay_endpoint
    publisher.close()
    publisher.publish_removed([1])          # after close: ignored, no error
    assert publisher.num_dropped == 0
    assert replay.startswith("tcp://127.0.0.1:")


def test_bad_endpoint_raises_in_constructor() -> None:
    with pytest.raises(zmq.ZMQError):
        KVEventPublisher("tcp://*:not-a-port")
