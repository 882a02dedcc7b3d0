"""A prefix-cache reset: the pool forgets the cached blocks nobody holds and keeps its invariants, the
manager lists what requests and sessions still hold as BlockStored events, and the local store tiers
drop every block no session pins (no model, no server)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence

from support.scheduler_parts import BLOCK_SIZE, compute, make_kv, make_request
from support.tier_sinks import RecordingSink

from kvhive.core.kv_events import MEDIUM_GPU, BlockStored
from kvhive.kv.held_blocks import stored_runs
from kvhive.kv.pool import BlockPool
from kvhive.store.disk import DiskStore
from kvhive.store.key import KeySpace, StoreKey
from kvhive.store.memory import MemoryStore
from kvhive.store.tiered import Tier, TierChange, TieredStore

SPACE = KeySpace("test-model", 1, "float32", 16)
BLOCK = 1000


def test_the_pool_forgets_evictable_blocks_and_keeps_used_ones_after_any_history() -> None:
    rng = random.Random(11)
    for _ in range(40):
        pool, held, next_hash = BlockPool(33), [], 0
        for _ in range(rng.randint(10, 200)):
            op = rng.random()
            if op < 0.4 and pool.num_free_blocks:
                held += pool.get_new_blocks(rng.randint(1, min(3, pool.num_free_blocks)))
            elif op < 0.65 and held:
                pool.free_blocks([held.pop(rng.randrange(len(held)))])
            elif op < 0.9 and held:
                next_hash += 1
                pool.cache_block(rng.choice(held), next_hash.to_bytes(8, "big"))
            elif pool.cached:
                block = pool.get_cached_block(rng.choice(list(pool.cached)))
                pool.touch([block])
                held.append(block)
        used_hashed = {b.block_hash: b for b in pool.blocks[1:] if b.ref_cnt > 0 and b.block_hash}
        evictable = pool.stats().num_evictable
        assert pool.reset_prefix_cache() == evictable
        pool.check_integrity()
        assert pool.cached == used_hashed
        assert pool.stats().num_evictable == 0
        assert pool.stats().num_free == pool.num_blocks - 1 - len({b.block_id for b in held})


def test_forgotten_blocks_are_handed_out_without_counting_as_evictions() -> None:
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(4)
    for i, block in enumerate(blocks):
        pool.cache_block(block, bytes([i]) * 8)
    pool.free_blocks(blocks[:3])
    pool.evicted_hashes = []
    assert pool.reset_prefix_cache() == 3
    assert sorted(b.block_id for b in pool.get_new_blocks(3)) == sorted(b.block_id for b in blocks[:3])
    assert pool.evicted_hashes == []                     # nothing left to evict: the reset said it all
    assert list(pool.cached.values()) == [blocks[3]]
    pool.check_integrity()


def test_stored_runs_name_the_hash_before_each_run_as_its_parent() -> None:
    hashes = [bytes([i]) * 16 for i in range(5)]
    tokens = list(range(5 * BLOCK_SIZE))
    first, second = stored_runs(hashes, tokens, [0, 1, 3], BLOCK_SIZE)
    assert (first.block_hashes, first.parent_block_hash, first.token_ids) == (hashes[:2], None, tokens[:8])
    assert (second.block_hashes, second.parent_block_hash, second.token_ids) == ([hashes[3]], hashes[2], tokens[12:16])
    assert {first.medium, second.medium} == {MEDIUM_GPU}


def announced(events: Sequence[BlockStored]) -> list[bytes]:
    return [h for event in events for h in event.block_hashes]


def test_the_manager_keeps_what_requests_and_sessions_hold_and_lists_it() -> None:
    kv = make_kv(num_blocks=40)
    kv.enable_events()
    done = make_request("done", range(100, 110))                 # finished: its 2 full blocks and its
                                                                 # partly filled one are evictable
    compute(kv, done)
    kv.free(done)
    shared = list(range(200, 208))                               # 2 blocks the request and the session share
    running = make_request("running", shared + list(range(300, 305)))
    compute(kv, running)
    session = make_request("s-turn", shared + list(range(400, 410)), session_id="s")
    hits = kv.get_computed_blocks(session)                       # admitted on the running request's blocks
    assert kv.allocate_slots(session, session.num_tokens - 8, hits.blocks)
    session.num_computed_tokens = hits.num_computed_tokens
    compute(kv, session)
    kv.park_session(session, "s")
    kv.take_events()
    reset = kv.reset_prefix_cache({"running": running})
    assert (reset.num_dropped, reset.num_kept) == (3, 3 + 2)
    kv.pool.check_integrity()
    assert sorted(announced(reset.stored)) == sorted(kv.pool.cached)       # every kept block, once each
    first, second = reset.stored
    assert (first.block_hashes, first.parent_block_hash) == (running.block_hashes[:3], None)
    assert first.token_ids == running.all_token_ids[:12]
    assert (second.block_hashes, second.parent_block_hash) == (session.block_hashes[2:4], session.block_hashes[1])
    assert second.token_ids == session.all_token_ids[8:16]
    assert kv.take_events() == []
    again = make_request("again", range(100, 111))
    assert kv.get_computed_blocks(again).num_computed_tokens == 0          # recomputed from scratch
    assert kv.get_computed_blocks(make_request("more", shared + [1, 2])).num_computed_tokens == 8
    turn = make_request("s-next", session.all_token_ids + [7, 7, 7], session_id="s")
    assert kv.sessions.prefix_of(turn) == session.num_computed_tokens          # the session resumes as before


def test_a_reset_drops_the_events_recorded_before_it() -> None:
    kv = make_kv(num_blocks=8)
    kv.enable_events()
    request = make_request("r", range(12))
    compute(kv, request)
    kv.free(request)
    reset = kv.reset_prefix_cache({})
    assert (reset.num_dropped, reset.stored, kv.take_events()) == (3, [], [])


def key(i: int) -> StoreKey:
    return SPACE.key(i.to_bytes(16, "big"))


def local_tiers(path: str, cpu_blocks: int = 8) -> tuple[TieredStore, MemoryStore, DiskStore]:
    """cpu (memory) over a write-through disk, as ``DurableState`` builds them."""
    cpu, disk = MemoryStore(cpu_blocks * BLOCK), DiskStore(path, 10_000_000, segment_bytes=3 * 1100)
    return TieredStore([Tier("cpu", cpu), Tier("disk", disk, write_through=True)]), cpu, disk


def test_local_tiers_drop_every_block_no_session_pins(tmp_path) -> None:
    store, cpu, disk = local_tiers(str(tmp_path))
    for i in range(12):
        store.put(key(i), bytes([i]) * BLOCK)
    store.pin_session("s", [key(10), key(11)])                   # pinned on disk, the keeper
    segments = {p.name for p in tmp_path.glob("seg-*")}
    assert store.drop_local() == {"cpu": 8, "disk": 10}           # the CPU tier held the last 8
    assert cpu.held_hashes(SPACE.prefix) == [] and cpu.stats().used_bytes == 0
    assert sorted(disk.held_hashes(SPACE.prefix)) == [key(10).block_hash, key(11).block_hash]
    assert len({p.name for p in tmp_path.glob("seg-*")}) < len(segments)   # segments left empty are gone
    assert disk.stats().used_bytes == sum(p.stat().st_size for p in tmp_path.glob("seg-*"))
    assert store.get(key(3)) is None and store.get(key(10)) == bytes([10]) * BLOCK
    store.close()
    reopened = DiskStore(str(tmp_path), 10_000_000, segment_bytes=3 * 1100)
    assert sorted(reopened.held_hashes(SPACE.prefix)) == [key(10).block_hash, key(11).block_hash]
    reopened.close()


def test_a_cpu_tier_that_keeps_session_pins_keeps_them_through_a_reset() -> None:
    cpu = MemoryStore(8 * BLOCK)
    store = TieredStore([Tier("cpu", cpu)])
    for i in range(5):
        store.put(key(i), bytes([i]) * BLOCK)
    store.pin_session("s", [key(1)])
    assert store.drop_local() == {"cpu": 4}
    assert cpu.held_hashes(SPACE.prefix) == [key(1).block_hash] and cpu.stats().used_bytes == BLOCK
    store.put(key(7), bytes([7]) * BLOCK)
    assert sorted(cpu.held_hashes(SPACE.prefix)) == [key(1).block_hash, key(7).block_hash]


def test_a_store_call_waits_while_the_held_blocks_are_restated(tmp_path) -> None:
    store, cpu, _ = local_tiers(str(tmp_path))
    sink = RecordingSink()
    store.send_events_to(sink, SPACE.prefix)
    for i in range(4):
        store.put(key(i), bytes([i]) * BLOCK)
    writer = threading.Thread(target=store.put, args=(key(9), bytes([9]) * BLOCK))

    def announce(held: list[TierChange]) -> None:
        writer.start()                                   # a save lands in the tiers during the listing
        while not cpu.contains([key(9)])[0]:
            time.sleep(0.001)
        assert all(key(9).block_hash not in c.block_hashes for calls in sink.calls for c in calls)
        sink.calls[:] = [held]                           # a consumer told to clear, then told this

    held = store.restate_held(SPACE.prefix, announce)
    writer.join()
    assert [c.tier for c in held] == ["cpu", "disk"]
    view = sink.view()
    assert view["cpu"] == set(cpu.held_hashes(SPACE.prefix)) and key(9).block_hash in view["cpu"]
    assert view["disk"] == {key(i).block_hash for i in (0, 1, 2, 3, 9)}
    store.close()
