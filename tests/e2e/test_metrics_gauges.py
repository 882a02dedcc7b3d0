"""/metrics is current while the server is idle: the device blocks by state (free, cached, used)
add up to the pool, and store saves that finish after the last request show without another one.

The pool's evictable counter under random transitions first, then the engine in process (tiny
random model), then a real server with a disk tier over HTTP.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import httpx
import pytest
from support.engines import make_engine, turn
from support.servers import ServerProcess, start_server, stop_server

from kvhive.config import StoreConfig
from kvhive.core.blocks import HASH_BYTES
from kvhive.core.model_files import default_model_path
from kvhive.core.tokenizer import Tokenizer
from kvhive.engine.async_engine import IDLE_STATS_REFRESH_S, AsyncEngine
from kvhive.engine.stats import EngineStats
from kvhive.kv.pool import BlockPool

GB = 2**30


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_model_path(default_model_path())


def test_the_evictable_count_follows_every_pool_transition() -> None:
    rng = random.Random(7)
    pool = BlockPool(17)
    held: list = []
    next_hash = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.35 and pool.num_free_blocks:
            held.extend(pool.get_new_blocks(rng.randint(1, min(3, pool.num_free_blocks))))
        elif op < 0.6 and held:
            block = held.pop(rng.randrange(len(held)))
            pool.free_blocks([block])
        elif op < 0.8 and held:
            next_hash += 1
            pool.cache_block(rng.choice(held), next_hash.to_bytes(8, "big"))
        elif pool.cached:
            block = pool.get_cached_block(rng.choice(list(pool.cached)))
            pool.touch([block])                    # a prefix hit, evictable or used
            held.append(block)
        pool.check_integrity()                     # includes: counter == evictable blocks
        s = pool.stats()
        assert 0 <= s.num_evictable <= min(s.num_free, s.num_cached)


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
    probe = make_engine(tokenizer)
    block_bytes = probe.block_bytes
    probe.close()
    engine = make_engine(tokenizer, store=StoreConfig(cpu_offload_gb=8 * block_bytes / GB))
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


@pytest.fixture()
def disk_server(tmp_path) -> Iterator[ServerProcess]:
    server = start_server("tiny", max_model_len=512, extra_args=("--disk-cache-dir", str(tmp_path),
                                                                 "--num-blocks", "128"))
    yield server
    stop_server(server)


def test_an_idle_server_shows_finished_saves_and_block_states(disk_server: ServerProcess) -> None:
    metric = disk_server.metric
    assert metric("kvhive_kv_blocks", {"state": "free"}) == 127
    prompt = " ".join(f"line {i} of a prompt long enough to fill some blocks." for i in range(30))
    r = httpx.post(f"{disk_server.base_url}/v1/completions", timeout=60,
                   json={"model": "smollm2-135m", "prompt": prompt, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    num_prompt = r.json()["usage"]["prompt_tokens"]
    # No request from here on: only the idle engine loop can bring the snapshot up to date.
    deadline, last = time.monotonic() + 30, -1.0
    while time.monotonic() < deadline:
        saved = metric("kvhive_kv_tier_bytes_in_total", {"tier": "disk"})
        if saved > 0 and saved == last:
            break                                   # the writer has caught up, and it shows
        last = saved
        time.sleep(4 * IDLE_STATS_REFRESH_S)
    assert saved > 0
    assert metric("kvhive_kv_tier_usage_bytes", {"tier": "disk"}) >= saved
    free, cached, used = (metric("kvhive_kv_blocks", {"state": s}) for s in ("free", "cached", "used"))
    assert used == 0 and cached >= num_prompt // 16 and free + cached + used == 127
    assert metric("kvhive_cache_num_blocks") == 128
