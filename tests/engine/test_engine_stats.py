"""The engine's stats split the device blocks by state (free, cached, used) and add up to the pool, and
the idle engine loop refreshes them when a store save finishes after the last step (tiny random model
in process)."""

from __future__ import annotations

import time

from support.engines import make_engine, make_engine_with_cpu_tier, turn

from kvhive.core.blocks import HASH_BYTES
from kvhive.core.tokenizer import Tokenizer
from kvhive.engine.async_engine import IDLE_STATS_REFRESH_S, AsyncEngine
from kvhive.engine.stats import EngineStats


def block_states(s: EngineStats) -> tuple[int, int, int]:
    return s.free_blocks, s.cached_blocks, s.used_blocks


def test_engine_stats_split_the_pool_by_state(tokenizer: Tokenizer) -> None:
    engine = make_engine(tokenizer, num_blocks=64, block_size=4)
    try:
        assert block_states(engine.stats()) == (63, 0, 0)
        turn(engine, "a", list(range(10, 30)))       # 20 prompt tokens + output: full blocks cached
        free, cached, used = block_states(engine.stats())
        assert used == 0 and cached >= 5 and free + cached + used == 63
        turn(engine, "b", list(range(40, 60)), session_id="s")
        free, cached, used = block_states(engine.stats())
        assert used == engine.stats().num_session_blocks > 0 and free + cached + used == 63
    finally:
        engine.close()


def test_the_idle_engine_loop_refreshes_its_stats(tokenizer: Tokenizer) -> None:
    engine = make_engine_with_cpu_tier(tokenizer, 8)
    block_bytes = engine.block_bytes
    async_engine = AsyncEngine(engine)
    async_engine.start()
    try:
        time.sleep(2 * IDLE_STATS_REFRESH_S)
        before = async_engine.stats().tiers[0].store.bytes_in
        # What a store writer does when a save finishes after the engine's last step.
        key = engine.connector_scheduler.key_space.key(b"\x07" * HASH_BYTES)
        engine.store.put(key, bytes(block_bytes))
        start = time.monotonic()
        while async_engine.stats().tiers[0].store.bytes_in == before:
            assert time.monotonic() - start < 10 * IDLE_STATS_REFRESH_S, "the idle snapshot never changed"
            time.sleep(0.05)
        assert async_engine.stats().tiers[0].store.bytes_in == before + block_bytes
        assert time.monotonic() - start < 4 * IDLE_STATS_REFRESH_S
    finally:
        async_engine.shutdown()
