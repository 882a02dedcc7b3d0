"""kvhive's KV events read by independent decoders: vLLM's msgspec structs and llm-d's subscriber.

Every event kind goes over a real ZMQ PUB socket to a SUB socket filtering on llm-d's ``kv@``, in
both encodings and both hash formats, and is decoded with the structs or rules of the other system
(tests/support/kv_event_decoders.py), never with ``kvhive.core.kv_events.decode_batch``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import zmq
from support.kv_event_decoders import llmd_decode, receive, subscribe, vllm_decode

from kvhive.core.kv_events import BlockRemoved, BlockStored
from kvhive.core.kv_events_config import KVEventsConfig
from kvhive.kv.event_publisher import KVEventPublisher, open_publisher
from kvhive.kv.tier_events import TierEventForwarder
from kvhive.store.tiered import TierChange

msgspec = pytest.importorskip("msgspec")

MODEL = "smollm2-135m"
POD = "10.0.0.5"
DIGESTS = [bytes([i]) * 8 + bytes(range(i, i + 8)) for i in (1, 2, 3)]   # 16-byte kvhive digests
TOKENS = list(range(100, 148))                                          # 3 blocks of 16


def low64(digest: bytes) -> int:
    """vLLM's int form of a digest: big-endian, low 64 bits."""
    return int.from_bytes(digest, "big") & ((1 << 64) - 1)


@dataclass
class Stream:
    """A publisher built from a KVEventsConfig and a SUB socket on llm-d's topic filter."""

    config: KVEventsConfig
    publisher: KVEventPublisher
    sub: zmq.Socket

    def settle(self) -> None:
        """PUB drops what it sends before the subscription arrives: probe until one gets through."""
        for _ in range(200):
            self.publisher.publish_cleared()
            if self.sub.poll(50):
                while self.sub.poll(200):
                    self.sub.recv_multipart()
                return
        raise AssertionError("subscriber never connected")


@pytest.fixture(params=[("map", "bytes"), ("map", "int64"), ("array", "bytes"), ("array", "int64")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def stream(request: pytest.FixtureRequest) -> Iterator[Stream]:
    encoding, hash_format = request.param
    config = KVEventsConfig(True, endpoint="tcp://127.0.0.1:*", topic="kv@{host}@{model}", encoding=encoding,
                            hash_format=hash_format, data_parallel_rank=0).for_server(POD, 8000)
    publisher = open_publisher(config, MODEL)
    ctx = zmq.Context()
    sub = subscribe(ctx, publisher.endpoint, b"kv@")
    try:
        s = Stream(config, publisher, sub)
        s.settle()
        yield s
    finally:
        publisher.close()
        sub.close()
        ctx.term()


def publish_every_kind(stream: Stream) -> None:
    """One batch each: cleared; two device blocks; a child block; tier moves; a device removal."""
    p = stream.publisher
    p.publish_cleared()
    p.publish_stored(DIGESTS[:2], None, TOKENS[:32], 16)
    p.publish_stored(DIGESTS[2:], DIGESTS[1], TOKENS[32:], 16)
    TierEventForwarder(p, 16).tiers_changed([TierChange("cpu", True, tuple(DIGESTS)),
                                            TierChange("disk", True, (DIGESTS[0],)),
                                            TierChange("redis", False, (DIGESTS[2],))])
    p.publish([BlockRemoved(DIGESTS[1:], "GPU")])


def wire(stream: Stream, digest: bytes) -> bytes | int:
    return low64(digest) if stream.config.int_hashes else digest


def test_vllm_structs_decode_every_event_kind(stream: Stream) -> None:
    publish_every_kind(stream)
    messages = receive(stream.sub, 5)
    assert [topic for topic, _, _ in messages] == [f"kv@{POD}@{MODEL}".encode()] * 5
    seqs = [seq for _, seq, _ in messages]
    assert seqs == list(range(seqs[0], seqs[0] + 5))
    array_like = stream.config.encoding == "array"
    batches = [vllm_decode(payload, array_like) for _, _, payload in messages]
    assert all(b.data_parallel_rank == 0 for b in batches)
    kinds = [[type(e).__name__ for e in b.events] for b in batches]
    assert kinds == [["AllBlocksCleared"], ["BlockStored"], ["BlockStored"],
                     ["BlockStored", "BlockStored", "BlockRemoved"], ["BlockRemoved"]]
    w = [wire(stream, d) for d in DIGESTS]
    first, child = batches[1].events[0], batches[2].events[0]
    assert (first.block_hashes, first.parent_block_hash, first.token_ids, first.block_size, first.medium) == \
        (w[:2], None, TOKENS[:32], 16, "GPU")
    assert (child.block_hashes, child.parent_block_hash, child.token_ids) == (w[2:], w[1], TOKENS[32:])
    cpu, disk, remote = batches[3].events
    assert (cpu.block_hashes, cpu.medium, cpu.token_ids, cpu.parent_block_hash) == (w, "CPU", [], None)
    assert (disk.block_hashes, disk.medium) == ([w[0]], "DISK")
    assert (remote.block_hashes, remote.medium) == ([w[2]], "REMOTE")
    assert (batches[4].events[0].block_hashes, batches[4].events[0].medium) == (w[1:], "GPU")


def test_the_other_layout_does_not_decode(stream: Stream) -> None:
    """A decoder of the other encoding fails: the encoding a consumer expects must be chosen."""
    stream.publisher.publish_stored(DIGESTS[:1], None, TOKENS[:16], 16)
    (_, _, payload), = receive(stream.sub, 1)
    with pytest.raises(msgspec.ValidationError):
        vllm_decode(payload, array_like=stream.config.encoding != "array")


def test_llmd_subscriber_reads_pod_model_and_uint64_hashes(stream: Stream) -> None:
    publish_every_kind(stream)
    messages = receive(stream.sub, 5)
    if stream.config.encoding == "map":
        # llm-d's vLLM adapter decodes the positional layout only: give it "encoding": "array".
        with pytest.raises(ValueError, match="not an array"):
            llmd_decode(*messages[1][::2])
        return
    batches = [llmd_decode(topic, payload) for topic, _, payload in messages]
    assert {(b.pod, b.model) for b in batches} == {(POD, MODEL)}
    ids = [low64(d) for d in DIGESTS]           # the same keys whichever hash_format was sent
    assert batches[0].events[0].kind == "AllBlocksCleared"
    stored, child = batches[1].events[0], batches[2].events[0]
    assert (stored.hashes, stored.parent, stored.tokens, stored.block_size, stored.tier) == \
        (ids[:2], 0, TOKENS[:32], 16, "gpu")
    assert (child.hashes, child.parent, child.tokens) == (ids[2:], ids[1], TOKENS[32:])
    cpu, disk, remote = batches[3].events
    assert (cpu.kind, cpu.hashes, cpu.tokens, cpu.tier) == ("BlockStored", ids, [], "cpu")
    assert (disk.tier, remote.kind, remote.tier, remote.hashes) == ("disk", "BlockRemoved", "remote", [ids[2]])
    assert (batches[4].events[0].hashes, batches[4].events[0].tier) == (ids[1:], "gpu")


def test_old_vllm_array_structs_read_what_the_engine_sent_before_extra_fields() -> None:
    """An array batch kvhive writes also decodes with the struct fields of the first vLLM releases
    (BlockStored up to lora_id, BlockRemoved with hashes only): extra trailing fields are ignored."""
    import msgpack

    from kvhive.core.kv_events import EventBatch, encode_batch

    payload = encode_batch(EventBatch(1.0, [BlockStored([1], None, [5] * 16, 16), BlockRemoved([1])], 0),
                           as_map=False)
    body = msgpack.unpackb(payload)
    assert body[1][0][:6] == ["BlockStored", [1], None, [5] * 16, 16, None]
    assert body[1][1][:2] == ["BlockRemoved", [1]]
