"""The offload connector on a tiny random model: tokens equal a fresh run for every tier a prefix
comes from (device, CPU, disk, mixed), slow tiers park only their own request, failed or corrupt
loads fall back to recompute, and blocks are never leaked."""

from __future__ import annotations

import os
import threading
import time

import pytest
from support.engines import GREEDY, make_engine, run
from support.tiny import tiny_config, tiny_model

from kvhive.config import CacheConfig, EngineConfig, SchedulerConfig, StoreConfig
from kvhive.engine.llm_engine import LLMEngine
from kvhive.model.loader import LoadedModel
from kvhive.request import RequestStatus, SamplingParams
from kvhive.server.metrics import ServerMetrics
from kvhive.store.disk import DiskStore
from kvhive.store.memory import MemoryStore
from kvhive.store.tiered import Tier, TieredStore

PROMPT = [(7 * i + 3) % 250 + 3 for i in range(100)]          # 25 blocks of 4
FLOOD = {f"flood{i}": [100 + i] * 60 for i in range(4)}        # evicts PROMPT from a 40-block pool


@pytest.fixture(scope="module")
def fresh(tokenizer) -> list[int]:
    """Greedy tokens of PROMPT on an engine without any cache."""
    return run(make_engine(tokenizer, prefix=False), {"fresh": PROMPT})["fresh"][0]


def engine_on(tokenizer, store: TieredStore, num_blocks: int = 64) -> LLMEngine:
    """A tiny-model engine (as test_engine.make_engine builds it) over a given TieredStore."""
    cfg = tiny_config(max_position_embeddings=512)
    config = EngineConfig(model_path="tiny", cache=CacheConfig(block_size=4, num_blocks=num_blocks),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                                    max_model_len=512))
    return LLMEngine(config, loaded=LoadedModel(cfg, tiny_model(cfg), "tiny-engine-test"),
                     tokenizer=tokenizer, store=store)


def step_until(engine, done, timeout_s: float = 20.0) -> dict[str, list[int]]:
    """Step until ``done()``; the tokens each request produced meanwhile. Bounded by time, not by a
    step count: a step returns at once while a load or a slow tier's lookup (on a thread) is in
    flight, so the steps a transfer takes depend on the load on the machine."""
    tokens: dict[str, list[int]] = {}
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "no progress"
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def settle(engine) -> None:
    """Let every queued save reach the store."""
    engine.connector_worker.wait_for_save()


def evict_from_device(engine) -> None:
    run(engine, FLOOD)
    settle(engine)
    assert engine.scheduler.kv.get_computed_blocks(_probe()).num_computed_tokens == 0


def _probe():
    from kvhive.request import Request

    return Request("probe", list(PROMPT), GREEDY)


def tier_hits(engine) -> dict[str, int]:
    return {t.name: t.hit_tokens for t in engine.stats().tiers}


def assert_pool_clean(engine) -> None:
    pool = engine.scheduler.kv.pool
    pool.check_integrity()
    assert pool.stats().num_used == 0


class SlowStore:
    """A BlockStore wrapper whose gets and contains sleep (a slow tier), wait for their event (a
    stalled tier), or miss from a given block on; it counts both calls."""

    def __init__(self, inner, delay_s: float = 0.0, contains_delay_s: float = 0.0) -> None:
        self.inner, self.delay_s, self.contains_delay_s = inner, delay_s, contains_delay_s
        self.fail_keys: set = set()
        self.release = threading.Event()              # gets wait for it
        self.release.set()
        self.release_contains = threading.Event()     # lookups wait for it
        self.release_contains.set()
        self.num_gets = self.num_contains = 0

    def contains(self, keys):
        self.num_contains += 1
        self.release_contains.wait(timeout=120)
        time.sleep(self.contains_delay_s)
        return self.inner.contains(keys)

    def get(self, key):
        self.num_gets += 1
        self.release.wait()
        time.sleep(self.delay_s)
        return None if key in self.fail_keys else self.inner.get(key)

    def put(self, key, payload):
        return self.inner.put(key, payload)

    def delete(self, key):
        self.inner.delete(key)

    def stats(self):
        return self.inner.stats()

    def close(self):
        self.inner.close()


def engine_with_prompt_below(tokenizer, slow: SlowStore) -> LLMEngine:
    """An engine over the one tier ``slow`` that has served PROMPT, now evicted from its device pool."""
    engine = engine_on(tokenizer, TieredStore([Tier("slow", slow)]))
    run(engine, {"cold": PROMPT})
    settle(engine)
    evict_from_device(engine)
    return engine


def test_device_and_cpu_hits_give_fresh_tokens(tokenizer, fresh):
    engine = make_engine(tokenizer, num_blocks=40, store=StoreConfig(cpu_offload_gb=0.01))
    try:
        assert run(engine, {"cold": PROMPT})["cold"] == (fresh, 0)
        settle(engine)
        # device pool hit: the full blocks, and the tokens before the last copied from the block
        # the first run's reply filled
        assert run(engine, {"device": PROMPT})["device"] == (fresh, len(PROMPT) - 1)
        assert tier_hits(engine)["cpu"] == 0
        evict_from_device(engine)
        assert run(engine, {"cpu": PROMPT})["cpu"] == (fresh, 96)           # CPU tier hit, sync load
        assert tier_hits(engine)["cpu"] == 96
        c = engine.stats().connector
        assert c.sync_loads >= 1 and c.async_loads == 0 and c.failed_load_blocks == 0
        settle(engine)
        assert_pool_clean(engine)
    finally:
        engine.close()


def test_disk_hit_survives_a_new_engine_and_mixed_tiers_load(tokenizer, fresh, tmp_path):
    store = StoreConfig(cpu_offload_gb=0.01, disk_cache_dir=str(tmp_path))
    first = make_engine(tokenizer, num_blocks=40, store=store)
    run(first, {"cold": PROMPT})
    first.close()                                   # a new engine: nothing in memory or on device
    engine = make_engine(tokenizer, num_blocks=40, store=store)
    try:
        assert run(engine, {"disk": PROMPT})["disk"] == (fresh, 96)         # disk hit, async load
        assert tier_hits(engine) == {"cpu": 0, "disk": 96}
        evict_from_device(engine)
        # Drop the odd blocks from the CPU tier (they were promoted there): a mixed-tier prefix.
        cpu = engine.store.tiers[0].store
        keys = engine.connector_scheduler.key_space.keys(_probe_hashes(engine))
        for key in keys[1::2]:
            cpu.delete(key)
        assert run(engine, {"mixed": PROMPT})["mixed"] == (fresh, 96)
        hits = tier_hits(engine)
        assert hits["cpu"] == 96 // 2 and hits["disk"] == 96 + 96 // 2
        assert engine.stats().connector.async_loads == 2
        settle(engine)
        assert_pool_clean(engine)
    finally:
        engine.close()


def _probe_hashes(engine) -> list[bytes]:
    request = _probe()
    engine.scheduler.kv._update_block_hashes(request)
    return request.block_hashes[:24]


def test_corrupt_disk_objects_are_misses_and_tokens_stay_fresh(tokenizer, fresh, tmp_path):
    store = StoreConfig(disk_cache_dir=str(tmp_path))
    first = make_engine(tokenizer, num_blocks=40, store=store)
    run(first, {"cold": PROMPT})
    first.close()
    segments = sorted(p for p in os.listdir(tmp_path) if p.endswith(".kvs"))
    path = os.path.join(tmp_path, segments[0])
    size = os.path.getsize(path)
    with open(path, "r+b") as f:                    # flip a byte in the payload of a middle record
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    engine = make_engine(tokenizer, num_blocks=40, store=store)
    try:
        tokens, cached = run(engine, {"again": PROMPT})["again"]
        assert tokens == fresh
        assert 0 < cached < 96
        assert engine.stats().connector.failed_load_blocks > 0
        assert {t.name: t.store.errors for t in engine.stats().tiers}["disk"] == 1
    finally:
        engine.close()
    with open(path, "r+b") as f:                    # truncate: the tail record is torn
        f.truncate(size - 100)
    engine = make_engine(tokenizer, num_blocks=40, store=store)
    try:
        assert run(engine, {"torn": PROMPT})["torn"][0] == fresh
    finally:
        engine.close()


def test_slow_tier_parks_only_its_request(tokenizer, fresh):
    slow = SlowStore(MemoryStore(1 << 24))
    engine = engine_with_prompt_below(tokenizer, slow)
    try:
        slow.release.clear()                        # the slow tier answers nothing for now
        engine.add_request("slow", PROMPT, GREEDY)
        engine.add_request("other", [9] * 30, GREEDY)
        other_tokens = 0
        for _ in range(200):
            for out in engine.step():
                assert out.request_id == "other"
                other_tokens += len(out.new_token_ids)
            if other_tokens >= 12:
                break
        assert other_tokens == 12                   # "other" finished while "slow" waited for KV
        assert engine.scheduler.get_request("slow").status is RequestStatus.WAITING_FOR_KV
        assert engine.stats().num_waiting == 1
        slow.release.set()
        tokens = step_until(engine, lambda: not engine.has_unfinished(), timeout_s=120)
        assert tokens["slow"] == fresh
    finally:
        engine.close()


def test_failed_load_recomputes_from_the_first_bad_block(tokenizer, fresh):
    slow = SlowStore(MemoryStore(1 << 24))
    engine = engine_with_prompt_below(tokenizer, slow)
    try:
        slow.fail_keys = set(engine.connector_scheduler.key_space.keys(_probe_hashes(engine))[10:11])
        assert run(engine, {"again": PROMPT})["again"] == (fresh, 40)        # blocks 0..9 loaded
        assert engine.stats().connector.failed_load_blocks == 14
        settle(engine)
        assert_pool_clean(engine)
    finally:
        engine.close()


def test_abort_while_loading_frees_blocks_after_the_load(tokenizer):
    slow = SlowStore(MemoryStore(1 << 24))
    engine = engine_with_prompt_below(tokenizer, slow)
    try:
        slow.release.clear()
        engine.add_request("gone", PROMPT, GREEDY)
        step_until(engine, lambda: engine.scheduler.get_request("gone").status is RequestStatus.WAITING_FOR_KV)
        engine.abort_request("gone")
        assert engine.scheduler.kv.pool.stats().num_used > 0    # held until the load reports back
        slow.release.set()
        step_until(engine, lambda: not engine.has_unfinished(), timeout_s=120)
        settle(engine)
        assert_pool_clean(engine)
    finally:
        engine.close()


def test_small_pool_with_cpu_tier_preempts_and_stays_correct(tokenizer):
    prompts = {f"r{j}": PROMPT[:60] + [(11 * j + k) % 250 + 3 for k in range(8)] for j in range(4)}
    roomy = run(make_engine(tokenizer, num_blocks=256, prefix=False), prompts)
    engine = make_engine(tokenizer, num_blocks=30, store=StoreConfig(cpu_offload_gb=0.01))
    try:
        for _ in range(2):
            tight = run(engine, prompts)
            assert {k: v[0] for k, v in tight.items()} == {k: v[0] for k, v in roomy.items()}
        settle(engine)
        assert engine.stats().num_preemptions > 0 and tier_hits(engine)["cpu"] > 0
        assert_pool_clean(engine)
    finally:
        engine.close()


def test_tier_metrics_are_exported(tokenizer, tmp_path):
    engine = make_engine(tokenizer, num_blocks=40, store=StoreConfig(cpu_offload_gb=0.01,
                                                                     disk_cache_dir=str(tmp_path)))
    try:
        run(engine, {"cold": PROMPT})
        settle(engine)
        evict_from_device(engine)
        run(engine, {"cpu": PROMPT})
        text = ServerMetrics(engine.stats, "m").render()[0].decode()
    finally:
        engine.close()
    for line in ('kvhive_kv_tier_hit_tokens_total{model_name="m",tier="cpu"} 96.0',
                 'kvhive_kv_tier_miss_tokens_total{model_name="m",tier="disk"}',
                 'kvhive_kv_tier_bytes_in_total{model_name="m",tier="disk"}',
                 'kvhive_kv_tier_load_seconds_count{model_name="m",tier="cpu"}',
                 'kvhive_kv_tier_usage_bytes{model_name="m",tier="cpu"}',
                 'kvhive_kv_tier_budget_bytes{model_name="m",tier="disk"}',
                 'kvhive_kv_tier_evictions_total{model_name="m",tier="cpu"} 0.0',
                 'kvhive_kv_connector_sync_loads_total{model_name="m"} 1.0'):
        assert line in text, line


def test_engine_close_persists_the_disk_tier(tokenizer, tmp_path):
    engine = make_engine(tokenizer, num_blocks=40, store=StoreConfig(disk_cache_dir=str(tmp_path)))
    run(engine, {"cold": PROMPT})
    engine.close()                                  # drains the writer, writes the index snapshot
    assert os.path.exists(tmp_path / "index.snapshot")
    store = DiskStore(str(tmp_path), 1 << 30)
    try:
        assert store.stats().used_bytes > 0
    finally:
        store.close()


HOG = [(3 * i + 1) % 250 + 3 for i in range(80)]       # 20 blocks: PROMPT's 25 cannot fit beside it


def test_request_waiting_for_blocks_looks_up_once_and_abort_drops_its_payloads(tokenizer, fresh):
    engine = make_engine(tokenizer, num_blocks=40, store=StoreConfig(cpu_offload_gb=0.01))
    try:
        run(engine, {"cold": PROMPT})
        settle(engine)
        evict_from_device(engine)
        engine.add_request("hog", HOG, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
        engine.step()
        cpu = engine.store.tiers[0].store
        gets_before = cpu.stats().hits
        engine.add_request("waiter", PROMPT, GREEDY)
        for _ in range(8):                          # matched in the CPU tier, but no blocks for it
            engine.step()
            assert engine.scheduler.get_request("waiter").status is RequestStatus.WAITING
        assert cpu.stats().hits - gets_before == 24            # payloads taken once, not per step
        assert engine.connector_scheduler.num_held_lookups() == 1
        engine.abort_request("waiter")                         # client gone while it waits
        assert engine.connector_scheduler.num_held_lookups() == 0
        step_until(engine, lambda: not engine.has_unfinished())
        assert run(engine, {"again": PROMPT})["again"] == (fresh, 96)
        assert engine.connector_scheduler.num_held_lookups() == 0
        settle(engine)
        assert_pool_clean(engine)
    finally:
        engine.close()


def test_abort_during_a_slow_load_cuts_it_short_and_the_prompt_still_hits(tokenizer, fresh):
    slow = SlowStore(MemoryStore(1 << 24), delay_s=0.05)        # 24 blocks: 1.2 s to load them all
    engine = engine_with_prompt_below(tokenizer, slow)
    try:
        slow.num_gets = 0
        engine.add_request("gone", PROMPT, GREEDY)
        step_until(engine, lambda: engine.scheduler.get_request("gone").status is RequestStatus.WAITING_FOR_KV)
        assert engine.connector_scheduler.num_held_lookups() == 0     # consumed by the admission
        engine.abort_request("gone")
        step_until(engine, lambda: not engine.has_unfinished())      # the load reports back, cut short
        assert slow.num_gets < 12
        assert engine.stats().connector.failed_load_blocks == 0     # cancelled is not failed
        assert engine.connector_scheduler.num_held_lookups() == 0
        settle(engine)
        assert_pool_clean(engine)
        assert run(engine, {"again": PROMPT})["again"] == (fresh, 96)
        settle(engine)
        assert_pool_clean(engine)
    finally:
        engine.close()


def test_slow_tier_lookup_does_not_stall_running_requests(tokenizer, fresh):
    slow = SlowStore(MemoryStore(1 << 24))
    engine = engine_with_prompt_below(tokenizer, slow)
    try:
        engine.add_request("other", [9] * 30, GREEDY)
        engine.step()                                              # "other" runs
        hits_before = tier_hits(engine)["slow"]
        slow.release_contains.clear()                              # the tier's lookups stall
        slow.num_contains = 0
        engine.add_request("slow", PROMPT, GREEDY)
        other_done = False
        for _ in range(200):                   # a lookup on the loop would hang the first step
            for out in engine.step():
                assert out.request_id == "other"
                other_done = other_done or out.finished
            assert engine.scheduler.get_request("slow").status is RequestStatus.WAITING
            if other_done:
                break
        assert other_done                      # "other" ran to its end while "slow" was looked up
        slow.release_contains.set()
        while engine.scheduler.get_request("slow").status is RequestStatus.WAITING:
            assert engine.step() == []
        assert slow.num_contains == 1               # one lookup, not one per step
        tokens = step_until(engine, lambda: not engine.has_unfinished())
        assert tokens["slow"] == fresh
        assert tier_hits(engine)["slow"] - hits_before == 96
        settle(engine)
        assert_pool_clean(engine)
    finally:
        engine.close()
