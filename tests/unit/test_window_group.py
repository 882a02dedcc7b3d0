"""WindowGroup and the manager's window pool: release as the window slides, hits shortened to
where the window parts are kept, sessions, sizing."""

from __future__ import annotations

from dataclasses import replace

from kvhive.kv.manager import KVCacheManager
from kvhive.kv.pool import NULL_BLOCK_ID
from kvhive.kv.window_group import WindowGroup, WindowLayout, window_layout
from kvhive.request import Request, SamplingParams

B = 4
LAYOUT = WindowLayout((True, False), window=6, num_blocks=12)


def _request(rid: str, n: int, session_id: str | None = None) -> Request:
    return Request(rid, list(range(100, 100 + n)), SamplingParams(max_tokens=4), session_id=session_id)


def _manager() -> KVCacheManager:
    return KVCacheManager(B, 16, True, b"root" * 8, window=LAYOUT)


def _compute(kv: KVCacheManager, request: Request, num_tokens: int) -> None:
    """As a step does: allocate, compute, cache the full blocks, release what the window left."""
    assert kv.allocate_slots(request, num_tokens)
    request.num_computed_tokens += num_tokens
    kv.cache_full_blocks(request, request.num_computed_tokens)
    kv.slide_window(request)


def test_blocks_behind_every_window_are_released_and_cached_for_reuse() -> None:
    kv = _manager()
    r = _request("r", 24)
    _compute(kv, r, 8)
    assert kv.get_window_table(r).count(NULL_BLOCK_ID) == 0          # next row at 8 sees 3..8: block 0
    _compute(kv, r, 12)                                              # next row at 20 sees 15..20
    window = kv.get_window_table(r)
    assert window[:3] == [NULL_BLOCK_ID] * 3 and NULL_BLOCK_ID not in window[3:]
    assert len(kv.get_block_table(r)) == 5 and kv.window.num_held("r") == 2
    assert kv.window.stats().num_used == 2 and kv.window.stats().num_evictable == 3
    kv.window.pool.check_integrity()
    kv.free(r)
    assert kv.window.stats().num_used == 0
    kv.window.pool.check_integrity()


def test_a_hit_is_shortened_to_where_the_window_parts_are_kept() -> None:
    kv = _manager()
    first = _request("a", 21)
    _compute(kv, first, 21)
    kv.free(first)
    again = _request("b", 21)
    assert kv.get_computed_blocks(again).num_computed_tokens == 20
    group: WindowGroup = kv.window
    h = again.block_hashes
    _keep_only(group, [h[2], h[3], h[4]])
    assert group.usable_hit(h, 5) == 5                   # a row at 20 sees 15..20: blocks 3 and 4
    _keep_only(group, [h[2], h[3]])
    assert group.usable_hit(h, 5) == 4                   # block 4's gone: a row at 16 sees 11..16
    _keep_only(group, [h[3]])
    assert group.usable_hit(h, 5) == 0 and kv.get_computed_blocks(again).num_computed_tokens == 0
    group.pool.check_integrity()


def _keep_only(group: WindowGroup, hashes: list[bytes]) -> None:
    """Evict every cached window part but these (as other requests' allocations would)."""
    kept = [group.pool.cached[h] for h in hashes if h in group.pool.cached]
    group.pool.touch(kept)
    taken = group.pool.get_new_blocks(group.pool.num_free_blocks)
    group.pool.free_blocks(taken + kept)
    assert set(group.pool.cached) == {h for h in hashes if any(b.block_hash == h for b in kept)}


def test_a_parked_session_keeps_only_its_last_window() -> None:
    kv = _manager()
    r = _request("r", 22, session_id="s")
    _compute(kv, r, 22)
    kv.park_session(r, "s")
    held = kv.window.table(("session", "s"))
    assert held[:4] == [NULL_BLOCK_ID] * 4 and held[4:] != [NULL_BLOCK_ID] * 2
    nxt = Request("r2", r.all_token_ids[:22] + [7] * 8, SamplingParams(max_tokens=4), session_id="s")
    assert kv.sessions.prefix_of(nxt) == 22 and kv.resume_session(nxt, 8)
    assert kv.window.table(("session", "s")) is None and len(kv.get_window_table(nxt)) == 8
    kv.free(nxt)
    assert kv.window.stats().num_used == 0
    kv.window.pool.check_integrity()


def test_the_window_pool_is_sized_by_windows_and_the_step_budget() -> None:
    layout = window_layout([True, False] * 3, 1024, 16, 100_000, 8, 2048)
    assert layout.num_blocks == 2 * (8 * (64 + 2) + 128 + 1) and layout.num_window_layers == 3
    assert window_layout([True] * 4, 8, 16, 100, 2, 64) is None           # no global layer
    assert window_layout([False] * 4, None, 16, 100, 2, 64) is None
    assert window_layout([True, False], 8, 16, 10, 2, 64).num_blocks == 10   # never more than the main pool


def _gemma(num_layers: int = 6, window: int = 64):
    from kvhive.config import GemmaSpec, ModelConfig

    flags = tuple(i % 6 != 5 for i in range(num_layers))            # Gemma 3: five window layers to one global
    return ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=num_layers, num_heads=2,
                       num_kv_heads=1, head_dim=8, gemma=GemmaSpec(8.0, flags, sliding_window=window))


def test_the_kv_budget_the_window_layers_leave_becomes_more_main_blocks() -> None:
    from kvhive.config import CacheConfig, EngineConfig, SchedulerConfig
    from kvhive.kv.window_group import fit_kv_budget, window_layout_for

    model = _gemma()
    config = EngineConfig("m", cache=CacheConfig(block_size=16, kv_cache_gb=0.01),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256))
    one_pool = config.cache.resolve_num_blocks(config.kv_bytes_per_block(model))
    fitted = fit_kv_budget(config, model, one_pool=False)
    layout = window_layout_for(model, fitted, False)
    per_layer = config.kv_bytes_per_block(model) // model.num_layers
    used = fitted.cache.num_blocks * per_layer * 1 + layout.num_blocks * per_layer * 5
    assert fitted.cache.num_blocks > 4 * one_pool                   # one global layer in six keeps every block
    assert used <= 0.01 * 2**30 < used + per_layer                   # the budget is filled, not exceeded
    # One pool (a connector moves whole blocks), an explicit count, or no window layers: unchanged.
    assert fit_kv_budget(config, model, one_pool=True) is config
    explicit = EngineConfig("m", cache=CacheConfig(num_blocks=9))
    assert fit_kv_budget(explicit, model, one_pool=False) is explicit
    llama = replace(model, gemma=None)
    assert fit_kv_budget(config, llama, one_pool=False) is config


def test_loaded_blocks_get_window_blocks_only_where_a_later_row_sees_them() -> None:
    """20 tokens loaded from a tier (5 blocks), 3 computed: a row at 20 sees 15..20, so only
    blocks 3 and 4 (and the new one) take window blocks; resuming at 8 lacks its window."""
    kv = KVCacheManager(B, 16, True, b"root" * 8, window=replace(LAYOUT, num_blocks=5))
    r = _request("r", 23)
    assert kv.allocate_slots(r, 23, (), num_loaded_tokens=20)         # 3 window blocks of 4 free
    window = kv.get_window_table(r)
    assert window[:3] == [NULL_BLOCK_ID] * 3 and NULL_BLOCK_ID not in window[3:]
    assert kv.window.num_held("r") == 3 and len(kv.get_block_table(r)) == 6
    assert kv.has_window_context(r, 20) and not kv.has_window_context(r, 8)
    assert kv.slide_window(r) == 0                                    # nothing more to release yet
    kv.free(r)
    kv.window.pool.check_integrity()
    assert not KVCacheManager(B, 16, True, b"root" * 8, window=replace(LAYOUT, num_blocks=3)).allocate_slots(
        _request("s", 23), 23, (), num_loaded_tokens=20)              # 2 free: short of 3
