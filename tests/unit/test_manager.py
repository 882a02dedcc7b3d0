"""KVCacheManager: prefix hits, salt isolation, the one-token rule, eviction order, reuse mid-request."""

from __future__ import annotations

import pytest

from kvhive.core import blocks as blocks_mod
from kvhive.core.blocks import root_hash
from kvhive.kv.manager import KVCacheManager
from kvhive.request import Request, SamplingParams

B = 4


def make(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), cache_salt=salt)


def admit(kv: KVCacheManager, req: Request, num_new: int | None = None) -> int:
    """Prefix lookup + allocation the way the scheduler does it; returns the hit length."""
    hit = kv.get_computed_blocks(req)
    n = req.num_tokens - hit.num_computed_tokens if num_new is None else num_new
    assert kv.allocate_slots(req, n, hit.blocks)
    req.num_computed_tokens = hit.num_computed_tokens
    if req.num_cached_tokens < 0:
        req.num_cached_tokens = hit.num_computed_tokens
    return hit.num_computed_tokens


def run_step(kv: KVCacheManager, req: Request, n: int) -> None:
    """What update_from_result does after a step computed n tokens."""
    req.num_computed_tokens += n
    kv.cache_full_blocks(req, req.num_computed_tokens)


@pytest.fixture
def kv() -> KVCacheManager:
    return KVCacheManager(B, 33, True, root_hash(0))


def test_prefix_hit_across_requests(kv):
    a = make("a", list(range(10)))                 # 2 full blocks + 2 tokens
    assert admit(kv, a) == 0
    run_step(kv, a, 10)
    kv.free(a)
    b = make("b", list(range(8)) + [99, 98, 97])   # shares the 2 full blocks
    assert admit(kv, b) == 8
    s = kv.stats()
    assert (s.prefix_cache_queries_tokens, s.prefix_cache_hits_tokens) == (10 + 11, 8)
    kv.pool.check_integrity()


def test_shared_blocks_are_the_same_pool_blocks(kv):
    a = make("a", list(range(12)))
    admit(kv, a)
    run_step(kv, a, 12)
    b = make("b", list(range(8)) + [1, 2, 3, 4, 5])
    admit(kv, b)
    ta, tb = kv.get_block_table(a), kv.get_block_table(b)
    assert ta[:2] == tb[:2] and ta[2] != tb[2]
    assert [kv.pool.blocks[i].ref_cnt for i in ta[:2]] == [2, 2]


def test_salt_isolation(kv):
    a = make("a", list(range(12)), salt="tenant-a")
    admit(kv, a)
    run_step(kv, a, 12)
    assert admit(kv, make("b", list(range(12)), salt="tenant-b")) == 0
    assert admit(kv, make("c", list(range(12)))) == 0
    assert admit(kv, make("d", list(range(12)), salt="tenant-a")) == 8


def test_at_least_one_token_is_computed(kv):
    a = make("a", list(range(8)))                  # exactly 2 full blocks
    admit(kv, a)
    run_step(kv, a, 8)
    kv.free(a)
    b = make("b", list(range(8)))
    assert admit(kv, b) == 4                       # last block recomputed
    c = make("c", list(range(9)))
    assert admit(kv, c) == 8
    assert admit(kv, make("d", [0, 1, 2])) == 0


def test_allocate_slots_fails_without_changes():
    kv = KVCacheManager(B, 4, True, root_hash(0))  # 3 usable blocks
    a = make("a", list(range(12)))
    assert admit(kv, a) == 0
    before = kv.pool.stats()
    b = make("b", [7] * 5)
    assert not kv.allocate_slots(b, 5)
    assert kv.pool.stats() == before and kv.get_block_table(b) == []
    run_step(kv, a, 12)
    assert not kv.allocate_slots(a, 1)             # a 13th token needs a 4th block
    assert len(kv.get_block_table(a)) == 3
    kv.pool.check_integrity()


def test_evictable_hits_count_against_free_blocks():
    kv = KVCacheManager(B, 5, True, root_hash(0))  # 4 usable
    a = make("a", list(range(8)))
    admit(kv, a)
    run_step(kv, a, 8)
    kv.free(a)                                     # 2 evictable + 2 empty
    b = make("b", list(range(9)) + [50] * 8)       # hit 2 blocks, needs 3 more (17 tokens)
    hit = kv.get_computed_blocks(b)
    assert hit.num_computed_tokens == 8
    assert not kv.allocate_slots(b, 9, hit.blocks) # 2 revived + 3 new > 4
    assert kv.pool.get_cached_block(b.block_hashes[0]) is not None
    assert kv.allocate_slots(b, 8, hit.blocks)     # 16 tokens: 2 revived + 2 new
    kv.pool.check_integrity()


def test_free_is_tail_first_so_chain_end_is_evicted_first():
    kv = KVCacheManager(B, 6, True, root_hash(0))  # 5 usable
    a = make("a", list(range(16)))
    admit(kv, a)
    run_step(kv, a, 16)
    table = kv.get_block_table(a)
    kv.free(a)
    # The never-used block first (nothing to lose), then a's chain from its end to its start.
    assert [b.block_id for b in kv.pool.free_queue] == [5] + table[::-1]
    # Needing two blocks evicts only the chain's last block: 3 blocks still hit.
    assert kv.allocate_slots(make("x", [9] * 8), 8)
    assert kv.get_computed_blocks(make("c", list(range(16)) + [1])).num_computed_tokens == 12


def test_blocks_cached_after_a_step_are_reused_while_first_request_runs(kv):
    system = list(range(100, 116))                 # 4-block shared system prompt
    a = make("a", system + [1, 2, 3])
    admit(kv, a, num_new=8)                        # chunked: first 8 tokens this step
    run_step(kv, a, 8)
    b = make("b", system + [4, 5])
    assert admit(kv, b) == 8                       # a still running, mid-prefill
    run_step(kv, b, b.num_tokens - 8)              # b computes the rest of the system prompt
    assert kv.allocate_slots(a, 11)
    run_step(kv, a, 11)                            # a computes blocks 2-3 too: duplicates of b's
    kv.pool.check_integrity()
    c = make("c", system + [6])
    assert admit(kv, c) == 16
    tb, tc = kv.get_block_table(b), kv.get_block_table(c)
    assert tc[:4] == tb[:4]                        # one mapping per hash: b's blocks were first
    for r in (a, b, c):
        kv.free(r)
    kv.pool.check_integrity()
    assert kv.pool.stats().num_used == 0


def test_hashing_is_incremental(kv, monkeypatch):
    calls: list[int] = []
    real = blocks_mod.hash_blocks

    def counting(tokens, block_size, root, extra=None, start_block=0, parent=None):
        out = real(tokens, block_size, root, extra, start_block, parent)
        calls.append(len(out))
        return out

    monkeypatch.setattr("kvhive.kv.manager.hash_blocks", counting)
    a = make("a", list(range(10)))
    admit(kv, a)
    run_step(kv, a, 10)
    assert sum(calls) == 2
    for t in range(40):                            # decode 40 tokens
        a.append_output_token(t)
        assert kv.allocate_slots(a, 1)
        run_step(kv, a, 1)
    assert sum(calls) == a.num_tokens // B == len(a.block_hashes)
    assert all(n <= 1 for n in calls[1:])          # one new block per call, never the whole prompt
    assert a.block_hashes == real(a.all_token_ids, B, root_hash(0), blocks_mod.ExtraKeys())


def test_block_table_is_shared_until_it_grows(kv):
    a = make("a", list(range(5)))
    admit(kv, a)
    run_step(kv, a, 5)
    t1 = kv.get_block_table(a)
    a.append_output_token(1)
    kv.allocate_slots(a, 1)
    run_step(kv, a, 1)
    assert kv.get_block_table(a) is t1             # no copy on a decode step that adds no block
    for t in range(3):
        a.append_output_token(t)
        kv.allocate_slots(a, 1)
        run_step(kv, a, 1)
    assert kv.get_block_table(a) is not t1 and len(kv.get_block_table(a)) == 3 and len(t1) == 2


def test_prefix_caching_disabled():
    kv = KVCacheManager(B, 9, False, root_hash(0))
    a = make("a", list(range(12)))
    admit(kv, a)
    run_step(kv, a, 12)
    assert a.block_hashes == [] and kv.pool.stats().num_cached == 0
    assert admit(kv, make("b", list(range(12)))) == 0
    assert kv.stats().prefix_cache_queries_tokens == 0
