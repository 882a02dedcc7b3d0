"""KV events -> index over real ZMQ sockets: catch-up, gap -> replay, restart -> clear, vLLM hash mapping."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import msgpack
import pytest
import zmq

from kvhive.core.blocks import ExtraKeys, hash_blocks, root_hash
from kvhive.core.kv_events import BlockStored, EventBatch, decode_batch, encode_batch
from kvhive.kv.event_publisher import KVEventPublisher
from kvhive.routing.index import InMemoryIndex
from kvhive.routing.ingest import BlockKeyMapper, ReplicaIngest

ROOT = root_hash(0, "test-fingerprint")
B = 16


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def wait_until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def held(index: InMemoryIndex, replica: str, *keys: bytes) -> bool:
    return all(replica in holders for holders in index.lookup(list(keys))) and \
        len(index.lookup(list(keys))) == len(keys)


def probe(publisher: KVEventPublisher) -> None:
    publisher.publish_removed([h(999_999)])          # harmless: removes a block nobody holds


def connect(publisher: KVEventPublisher, ingest: ReplicaIngest) -> None:
    """Wait until the ingest's SUB socket receives from the publisher (PUB drops before that)."""
    deadline = time.monotonic() + 5
    while ingest._last_received is None:
        assert time.monotonic() < deadline, "subscriber never connected"
        probe(publisher)
        time.sleep(0.02)


@pytest.fixture()
def publisher() -> Iterator[KVEventPublisher]:
    pub = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    yield pub
    pub.close()


def test_publisher_to_index_for_a_kvhive_replica(publisher: KVEventPublisher) -> None:
    index = InMemoryIndex()
    ingest = ReplicaIngest("r1", index, BlockKeyMapper(False, B, ROOT), publisher.endpoint,
                           publisher.replay_endpoint)
    ingest.start()
    try:
        connect(publisher, ingest)
        publisher.publish_stored([h(1), h(2), h(3)], None, [], B)
        wait_until(lambda: held(index, "r1", h(1), h(2), h(3)))
        publisher.publish_stored([h(1)], None, [], B, medium="CPU")
        publisher.publish_removed([h(1)], medium="GPU")
        wait_until(lambda: index.lookup([h(1)]) == [{"r1": "CPU"}])
        publisher.publish_cleared()
        wait_until(lambda: index.lookup([h(1)]) == [] and index.lookup([h(2)]) == [])
        assert ingest.stats.gaps <= 1 and ingest.stats.lost == 0 and ingest.stats.decode_errors == 0
    finally:
        ingest.close()


def test_catch_up_replays_what_was_published_before_the_gateway_started(publisher: KVEventPublisher) -> None:
    for i in range(5):
        publisher.publish_stored([h(i)], None if i == 0 else h(i - 1), [], B)
    index = InMemoryIndex()
    ingest = ReplicaIngest("r1", index, BlockKeyMapper(False, B, ROOT), publisher.endpoint,
                           publisher.replay_endpoint)
    wait_until(lambda: publisher._next_seq == 5)
    ingest.start()
    try:
        wait_until(lambda: held(index, "r1", *(h(i) for i in range(5))))
        assert ingest.last_applied == 4 and ingest.stats.replayed == 5
    finally:
        ingest.close()


class LossyRelay:
    """Forwards a publisher's frames to its own PUB socket, dropping batches that store ``drop``."""

    def __init__(self, upstream: str, drop: bytes) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(upstream)
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.drop = drop
        self.dropped = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.is_set():
            if self.sub.poll(20):
                frames = self.sub.recv_multipart()
                events = decode_batch(frames[2]).events
                if any(isinstance(e, BlockStored) and e.block_hashes[0] == self.drop for e in events):
                    self.dropped += 1
                    continue
                self.pub.send_multipart(frames)
        self.sub.close(linger=0)
        self.pub.close(linger=0)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.ctx.term()


def test_a_sequence_gap_is_filled_from_the_replay_socket(publisher: KVEventPublisher) -> None:
    relay = LossyRelay(publisher.endpoint, drop=h(2))
    index = InMemoryIndex()
    ingest = ReplicaIngest("r1", index, BlockKeyMapper(False, B, ROOT), relay.endpoint,
                           publisher.replay_endpoint)
    ingest.start()
    try:
        connect(publisher, ingest)
        gaps = ingest.stats.gaps
        publisher.publish_stored([h(1)], None, [], B)
        publisher.publish_stored([h(2)], h(1), [], B)      # lost on the way
        publisher.publish_stored([h(3)], h(2), [], B)
        wait_until(lambda: held(index, "r1", h(1), h(2), h(3)))
        assert relay.dropped == 1
        assert ingest.stats.gaps == gaps + 1 and ingest.stats.lost == 0
    finally:
        ingest.close()
        relay.close()


def test_a_restarted_replica_is_cleared_and_reindexed() -> None:
    first = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    endpoint, replay = first.endpoint, first.replay_endpoint
    index = InMemoryIndex()
    index.add([h(500)], "other", "GPU")
    ingest = ReplicaIngest("r1", index, BlockKeyMapper(False, B, ROOT), endpoint, replay)
    ingest.start()
    try:
        connect(first, ingest)
        for i in range(30):
            first.publish_stored([h(100 + i)], None, [], B)
        wait_until(lambda: held(index, "r1", h(129)))
        first.close()
        # Same endpoints ("*" binds, as vLLM decides), sequence from 0 again.
        second = KVEventPublisher(endpoint.replace("127.0.0.1", "*"), replay)
        try:
            second.publish_stored([h(7)], None, [], B)
            deadline = time.monotonic() + 5
            while not held(index, "r1", h(7)):
                assert time.monotonic() < deadline
                probe(second)
                time.sleep(0.02)
            assert ingest.stats.resets == 1
            assert index.lookup([h(100)]) == [] and index.lookup([h(129)]) == []
            assert index.lookup([h(500)]) == [{"other": "GPU"}]     # other replicas untouched
        finally:
            second.close()
    finally:
        ingest.close()


def test_vllm_int_hashes_are_mapped_to_kvhive_keys_by_their_tokens() -> None:
    publisher = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", as_map=True)
    index = InMemoryIndex()
    ingest = ReplicaIngest("vllm-1", index, BlockKeyMapper(True, B, ROOT), publisher.endpoint,
                           publisher.replay_endpoint)
    tokens = list(range(1000, 1128))               # 8 kvhive blocks = 4 vLLM blocks of 32
    ours = hash_blocks(tokens, B, ROOT)
    ingest.start()
    try:
        connect(publisher, ingest)
        publisher.publish_stored([2**63 + 1, 2**63 + 2], None, tokens[:64], 32)
        publisher.publish_stored([2**63 + 3, 2**63 + 4], 2**63 + 2, tokens[64:], 32)
        wait_until(lambda: len(index.lookup(ours)) == 8)
        assert index.lookup(ours) == [{"vllm-1": "GPU"}] * 8
        publisher.publish_removed([2**63 + 4])
        wait_until(lambda: len(index.lookup(ours)) == 6)
        publisher.publish_stored([5], 12345, list(range(32)), 32)       # parent never seen: skipped
        wait_until(lambda: ingest.mapper.num_unmapped == 1)
    finally:
        ingest.close()
        publisher.close()


def test_mapper_keeps_a_block_while_any_tier_holds_it_and_mixes_lora_into_block_zero() -> None:
    mapper = BlockKeyMapper(True, B, ROOT)
    tokens = list(range(32))
    keys = mapper.stored(BlockStored([1, 2], None, tokens, B, None, "GPU"))
    assert keys == hash_blocks(tokens, B, ROOT)
    mapper.stored(BlockStored([2], 1, tokens[16:], B, None, "CPU"))
    from kvhive.core.kv_events import BlockRemoved

    assert mapper.removed(BlockRemoved([2], "GPU")) == keys[1:]
    child = mapper.stored(BlockStored([3], 2, list(range(32, 48)), B, None, "CPU"))
    assert child == hash_blocks(list(range(48)), B, ROOT)[2:]      # parent found through its CPU copy
    mapper.removed(BlockRemoved([2], "CPU"))
    assert mapper.stored(BlockStored([4], 2, list(range(16)), B)) == []
    lora = BlockKeyMapper(True, B, ROOT).stored(BlockStored([9], None, tokens[:16], B, 1, "GPU", "ad-1"))
    assert lora == hash_blocks(tokens[:16], B, ROOT, ExtraKeys(adapter_id="ad-1"))
    assert BlockKeyMapper(True, B, ROOT).stored(BlockStored([9], None, tokens[:24], 24)) == []
    assert BlockKeyMapper(True, B, ROOT).stored(BlockStored([9, 8], None, tokens[:16], B)) == []


def test_sequence_rules_without_sockets() -> None:
    """Gap -> replay of exactly the missed batches; duplicates skipped; lower seq -> reset."""
    buffer: dict[int, bytes] = {}
    fetched: list[int] = []

    def payload(i: int) -> bytes:
        return encode_batch(EventBatch(0.0, [BlockStored([h(i)], None, [], B)]))

    def replay(start: int) -> list[tuple[int, bytes]]:
        fetched.append(start)
        return [(s, p) for s, p in sorted(buffer.items()) if s >= start]

    index = InMemoryIndex()
    ingest = ReplicaIngest("r", index, BlockKeyMapper(False, B, ROOT), replay=replay)
    for i in range(6):
        buffer[i] = payload(i)
    ingest.on_batch(0, buffer[0])
    ingest.on_batch(3, buffer[3])                  # 1 and 2 missed
    assert fetched == [1] and ingest.last_applied == 3
    assert held(index, "r", h(0), h(1), h(2), h(3))
    ingest.on_batch(4, buffer[4])
    assert fetched == [1] and ingest.stats.batches == 5
    ingest.on_batch(2, buffer[2])                  # went back: the replica restarted
    assert ingest.stats.resets == 1 and fetched == [1, 0]
    assert ingest.last_applied == 2 and index.lookup([h(3)]) == []
    ingest.catch_up()                              # already in sequence: nothing to fetch
    assert fetched == [1, 0]
    ingest.reset()
    assert index.lookup([h(0)]) == [] and ingest.last_applied is None
    ingest.on_batch(5, msgpack.packb("garbage"))   # undecodable: counted, sequence still advances
    assert ingest.stats.decode_errors == 1 and ingest.last_applied == 5


def test_vllm_extra_keys_map_a_salted_request_to_salted_kvhive_keys() -> None:
    """vLLM's BlockStored carries each block's extra hash keys (untagged): a cache salt on block 0
    maps to kvhive's salted chain, the gateway's keys for a body with that ``cache_salt``."""
    tokens = list(range(2000, 2064))
    salted = hash_blocks(tokens, B, ROOT, ExtraKeys(cache_salt="tenant-a"))
    payload = msgpack.packb([1.0, [
        # vLLM's positional encoding, extra fields after extra_keys (group_idx, ...) included.
        ["BlockStored", [11, 12], None, tokens[:32], B, None, "GPU", None, [["tenant-a"], None], 0],
        ["BlockStored", [13, 14], 12, tokens[32:], B, None, "GPU", None, None, 0]]])
    index = InMemoryIndex()
    ingest = ReplicaIngest("vllm-1", index, BlockKeyMapper(True, B, ROOT))
    ingest.on_batch(0, payload)
    assert index.lookup(salted) == [{"vllm-1": "GPU"}] * 4
    assert index.lookup(hash_blocks(tokens, B, ROOT)) == []       # an unsalted prompt finds nothing
    assert index.lookup(hash_blocks(tokens, B, ROOT, ExtraKeys(cache_salt="tenant-b"))) == []
    # The map encoding, with a LoRA adapter: its name leads every block's keys; the salt follows.
    lora = BlockKeyMapper(True, B, ROOT)
    batch = decode_batch(msgpack.packb({"ts": 2.0, "events": [
        {"type": "BlockStored", "block_hashes": [21, 22], "parent_block_hash": None,
         "token_ids": tokens[:32], "block_size": B, "lora_id": 1, "medium": "GPU", "lora_name": "ad-1",
         "extra_keys": [["ad-1", "tenant-a"], ["ad-1"]]}]}))
    assert lora.stored(batch.events[0]) == hash_blocks(
        tokens[:32], B, ROOT, ExtraKeys(cache_salt="tenant-a", adapter_id="ad-1"))


def test_vllm_blocks_with_multimodal_or_embedding_keys_are_not_indexed() -> None:
    """kvhive's hash has no image or prompt-embedding keys, so such blocks (and the blocks chained
    after them) stay out of the index and are counted as unmapped, never indexed as text."""
    tokens = list(range(3000, 3064))
    mapper = BlockKeyMapper(True, B, ROOT)
    image = BlockStored([31, 32, 33], None, tokens[:48], B, None, "GPU", None,
                        [None, [["img-digest", 4]], None])
    assert mapper.stored(image) == hash_blocks(tokens[:16], B, ROOT)          # the text block before it
    assert mapper.num_unmapped == 2
    assert mapper.stored(BlockStored([34], 33, tokens[48:], B)) == []        # chained after the image
    assert mapper.num_unmapped == 3
    embeds = BlockStored([41], None, tokens[:16], B, None, "GPU", None, [[b"\x00" * 32]])
    assert mapper.stored(embeds) == [] and mapper.num_unmapped == 4
    two_strings = BlockStored([51], None, tokens[:16], B, None, "GPU", None, [["x", "y"]])
    assert mapper.stored(two_strings) == [] and mapper.num_unmapped == 5
    later_salt = BlockStored([61, 62], None, tokens[:32], B, None, "GPU", None, [None, ["late"]])
    assert mapper.stored(later_salt) == hash_blocks(tokens[:16], B, ROOT)    # a salt is block 0's only
