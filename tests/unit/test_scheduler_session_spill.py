"""Session spill: which idle session holding gives its device blocks back, and when."""

from __future__ import annotations

from support.scheduler_parts import make_kv, make_request, park

from kvhive.engine.scheduler.session_spill import SessionCopy, SessionSpill, TierSessionCopy
from kvhive.store.key import KeySpace
from kvhive.store.memory import MemoryStore
from kvhive.store.tiered import Tier, TieredStore


def parked(*session_ids):
    """A KV manager with one 8-token holding per session, parked in this order (LRU first)."""
    kv = make_kv()
    for i, sid in enumerate(session_ids):
        park(kv, sid, range(i * 10, i * 10 + 8))
    return kv


def copies_by_session(kv, where: dict[str, SessionCopy]):
    """A ``session_copy`` that answers ``where[session]`` for that session's full blocks."""
    by_hashes = {tuple(kv.sessions.get(sid).block_hashes[:2]): copy for sid, copy in where.items()}
    return lambda hashes: by_hashes[tuple(hashes)]


def test_without_tiers_holdings_go_least_recently_used_first_whenever_asked():
    kv = parked("old", "mid", "new")
    spill = SessionSpill(kv, None, set)
    assert spill.spill() and kv.sessions.ids() == ["mid", "new"]
    assert spill.spill(keep="mid") and kv.sessions.ids() == ["mid"]
    assert spill.num_spills == 2
    assert not spill.spill(keep="mid")


def test_the_least_recently_used_holding_with_a_copy_below_goes_first():
    kv = parked("pending", "none", "higher", "lowest")
    where = {"pending": SessionCopy.PENDING, "none": SessionCopy.NONE,
             "higher": SessionCopy.HIGHER, "lowest": SessionCopy.LOWEST}
    spill = SessionSpill(kv, copies_by_session(kv, where), set)
    assert spill.spill() and kv.sessions.ids() == ["pending", "none", "lowest"]
    assert spill.spill() and kv.sessions.ids() == ["pending", "none"]
    assert spill.spill() and kv.sessions.ids() == ["pending"]      # no copy: goes after those with one
    assert not spill.spill() and spill.num_spills == 3          # a pending copy waits for its saves


def test_a_holding_whose_blocks_are_not_yet_handed_to_saves_waits():
    kv = parked("s")
    pending = set(kv.sessions.get("s").block_hashes[1:2])
    spill = SessionSpill(kv, copies_by_session(kv, {"s": SessionCopy.LOWEST}), lambda: pending)
    assert not spill.spill()
    pending.clear()
    assert spill.spill() and kv.sessions.ids() == []


def test_the_kept_session_is_never_spilled():
    kv = parked("mine", "other")
    spill = SessionSpill(kv, lambda hashes: SessionCopy.LOWEST, set)
    assert spill.spill(keep="mine") and kv.sessions.ids() == ["mine"]
    assert not spill.spill(keep="mine")
    kv.pool.check_integrity()


def test_spilled_full_blocks_stay_cached_in_the_pool():
    kv = parked("s")
    hashes = kv.sessions.get("s").block_hashes
    assert SessionSpill(kv, None, set).spill()
    assert kv.count_cached(hashes) == 2 and kv.sessions.num_blocks == 0


def test_tier_session_copy_prefers_the_lowest_tier_then_waits_for_saves_then_looks_above():
    space = KeySpace("test-model", 1, "float32", 4)
    upper, lowest = MemoryStore(1 << 20), MemoryStore(1 << 20)
    store = TieredStore([Tier("cpu", upper), Tier("disk", lowest)])
    hashes = [bytes([i]) * 16 for i in range(3)]
    keys = space.keys(hashes)
    saving: set = set()
    copy = TierSessionCopy(store, space, lambda ks: any(k in saving for k in ks))
    assert copy(hashes) is SessionCopy.NONE
    for key in keys:
        upper.put(key, b"kv")
    assert copy(hashes) is SessionCopy.HIGHER
    saving.add(keys[0])
    assert copy(hashes) is SessionCopy.PENDING
    for key in keys:
        lowest.put(key, b"kv")
    assert copy(hashes) is SessionCopy.LOWEST


def test_a_block_two_sessions_share_counts_once():
    kv = make_kv()
    park(kv, "a", range(8))                         # two full blocks
    b = make_request("b-turn", [*range(8), 100, 101, 102, 103], session_id="b")
    hits = kv.get_computed_blocks(b)
    assert hits.num_computed_tokens == 8
    assert kv.allocate_slots(b, b.num_tokens - 8, hits.blocks)
    b.num_computed_tokens = b.num_tokens
    kv.cache_full_blocks(b, b.num_tokens)
    kv.park_session(b, "b")                          # holds a's two blocks and one of its own
    assert [len(kv.sessions.get(s).blocks) for s in ("a", "b")] == [2, 3]
    assert kv.sessions.num_blocks == 3
    assert kv.sessions.release("a") and kv.sessions.num_blocks == 3
    assert kv.sessions.release("b") and kv.sessions.num_blocks == 0
