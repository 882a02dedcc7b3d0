"""Retention through the KV manager: a request's ranges on its freed blocks, spilled sessions
pinned until they end, BlockUpdated events, and ``--offload-min-priority`` on the saves."""

from __future__ import annotations

import pytest
from support.scheduler_parts import BLOCK_SIZE, compute, make_kv, make_request, park

from kvhive.connector.base import CachedBlock, SchedulerOutput
from kvhive.core.kv_events import BlockStored, BlockUpdated, EventBatch, decode_batch, encode_batch
from kvhive.core.retention import (
    DEFAULT_PRIORITY,
    PINNED_PRIORITY,
    BlockRetention,
    RetentionRange,
    RetentionSpec,
)
from kvhive.engine.scheduler.kv_transfers import KVTransfers
from kvhive.engine.scheduler.session_spill import SessionSpill
from kvhive.kv.retention_policy import block_retentions


def test_block_retentions_follow_the_ranges_and_the_decode_priority():
    spec = RetentionSpec((RetentionRange(0, 4, 90, 60.0), RetentionRange(6, None, 20)), decode_priority=50)
    got = block_retentions(spec, 4, BLOCK_SIZE, 14, 10)
    # [0,4) 90; [4,8) overlaps [6,..) at 20; [8,12) 20 but holds output 10.. (decode 50); [12,14) decode 50
    assert got == [BlockRetention(90, 60.0), BlockRetention(20), BlockRetention(50), BlockRetention(50)]
    assert block_retentions(None, 2, BLOCK_SIZE, 8, 8) == [BlockRetention(DEFAULT_PRIORITY)] * 2


def test_a_freed_request_gives_its_blocks_its_retention():
    kv = make_kv()
    r = make_request("a", range(12), max_tokens=1)
    r.retention = RetentionSpec((RetentionRange(0, 8, 90),))
    compute(kv, r)
    blocks = list(kv._blocks["a"])
    kv.free(r)
    assert [b.priority for b in blocks] == [90, 90, DEFAULT_PRIORITY]
    one_off = make_request("b", range(12), max_tokens=1)   # hits the pinned prefix, gives none
    hits = kv.get_computed_blocks(one_off)
    assert kv.allocate_slots(one_off, 12 - hits.num_computed_tokens, hits.blocks)
    kv.free(one_off)
    assert [b.priority for b in blocks[:2]] == [90, 90]
    kv.pool.check_integrity()


def test_a_spilled_session_is_pinned_until_it_ends():
    kv = make_kv()
    park(kv, "s", range(8))
    blocks = list(kv.sessions.get("s").blocks)
    SessionSpill(kv, None, set).spill()
    assert [b.priority for b in blocks] == [PINNED_PRIORITY] * 2 and kv.sessions.ids() == []
    one_off = make_request("x", range(100, 120), max_tokens=1)
    compute(kv, one_off)
    kv.free(one_off)
    # The one-off prompt's blocks go before the spilled session's.
    queue = list(kv.pool.free_queue)
    assert queue.index(blocks[0]) > max(queue.index(b) for b in kv.pool.blocks if b.priority == DEFAULT_PRIORITY
                                        and b.block_hash is not None)
    kv.sessions.end("s")
    assert [b.priority for b in blocks] == [DEFAULT_PRIORITY] * 2
    kv.pool.check_integrity()


def test_a_released_session_takes_the_parking_requests_retention():
    kv = make_kv()
    r = make_request("s-turn", range(8), session_id="s")
    r.retention = RetentionSpec((RetentionRange(0, 4, 60),))
    compute(kv, r)
    blocks = list(kv._blocks["s-turn"])
    kv.park_session(r, "s")
    kv.sessions.end("s")
    assert [b.priority for b in blocks] == [60, DEFAULT_PRIORITY]


def test_priority_changes_become_block_updated_events_when_asked():
    kv = make_kv()
    kv.enable_events(priority_events=True)
    r = make_request("a", range(8), max_tokens=1)
    r.retention = RetentionSpec((RetentionRange(0, None, 70),))
    compute(kv, r)
    kv.take_events()
    kv.free(r)
    (event,) = kv.take_events()
    assert event == BlockUpdated(r.block_hashes[1::-1], 70, DEFAULT_PRIORITY)     # freed tail first
    quiet = make_kv()
    quiet.enable_events()
    compute(quiet, r2 := make_request("b", range(8), max_tokens=1))
    r2.retention = r.retention
    quiet.take_events()
    quiet.free(r2)
    assert quiet.take_events() == []


def test_block_updated_round_trips_in_both_encodings():
    event = BlockUpdated([b"\x01" * 16, b"\x02" * 16], 80, 35)
    for as_map in (True, False):
        (back,) = decode_batch(encode_batch(EventBatch(1.0, [event]), as_map=as_map)).events
        assert back == event


def test_blocks_below_the_offload_min_priority_are_not_saved():
    from kvhive.connector.offload import OffloadScheduler
    from kvhive.store.key import KeySpace
    from kvhive.store.memory import MemoryStore
    from kvhive.store.tiered import Tier, TieredStore

    store = TieredStore([Tier("cpu", MemoryStore(1 << 20))])
    offload = OffloadScheduler(store, KeySpace("m", 1, "float32", BLOCK_SIZE), 64, min_priority=50)
    cached = (CachedBlock(1, b"\x01" * 16, None, 80), CachedBlock(2, b"\x02" * 16, None, DEFAULT_PRIORITY),
              CachedBlock(3, b"\x03" * 16, None, 50))
    meta = offload.build_connector_meta(SchedulerOutput((), (), cached))
    assert [block_id for block_id, _ in meta.saves] == [1, 3]
    assert offload.stats().unsaved_low_priority == 1
    offload.close()


def test_saves_carry_the_priority_the_request_gives_each_block():
    kv = make_kv()
    transfers = KVTransfers(connector=object(), kv=kv)
    r = make_request("a", range(12), max_tokens=1)
    r.retention = RetentionSpec((RetentionRange(0, 4, 90),))
    compute(kv, r)
    transfers.note_computed(r, [0, 1, 2], 0)
    assert [b.priority for b in transfers.newly_cached] == [90, DEFAULT_PRIORITY, DEFAULT_PRIORITY]


def test_block_updated_is_opt_in_because_vllm_decoders_refuse_unknown_events():
    from support.kv_event_decoders import vllm_decode

    msgspec = pytest.importorskip("msgspec")
    stored = BlockStored([b"\x01" * 16], None, list(range(BLOCK_SIZE)), BLOCK_SIZE)
    for as_map in (True, False):
        payload = encode_batch(EventBatch(1.0, [stored]), as_map=as_map)
        assert len(vllm_decode(payload, array_like=not as_map).events) == 1
        payload = encode_batch(EventBatch(1.0, [stored, BlockUpdated([b"\x01" * 16], 80, 35)]), as_map=as_map)
        with pytest.raises(msgspec.ValidationError):
            vllm_decode(payload, array_like=not as_map)


def test_the_gateway_ingest_skips_block_updated():
    from kvhive.core.blocks import root_hash
    from kvhive.routing.index import InMemoryIndex
    from kvhive.routing.ingest import BlockKeyMapper, ReplicaIngest

    index = InMemoryIndex()
    ingest = ReplicaIngest("r1", index, BlockKeyMapper(False, BLOCK_SIZE, root_hash(0)), "tcp://127.0.0.1:9", None)
    digest = b"\x07" * 16
    batch = decode_batch(encode_batch(EventBatch(1.0, [
        BlockStored([digest], None, list(range(BLOCK_SIZE)), BLOCK_SIZE), BlockUpdated([digest], 80, 35)])))
    ingest.apply(batch)
    assert index.lookup([digest]) == [{"r1": "GPU"}]


@pytest.mark.parametrize("value", [-1, 101, True])
def test_the_offload_min_priority_is_bounded(value):
    from kvhive.config import StoreConfig

    with pytest.raises(ValueError, match="--offload-min-priority"):
        StoreConfig(offload_min_priority=value)
