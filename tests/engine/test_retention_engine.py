"""Retention and scheduling priority through ``LLMEngine.add_request`` on the tiny random model: a
high-priority prefix outlives one-off prompts that evict a default one, a duration ends, low
priority blocks stay out of the CPU tier, and ``priority`` needs the priority policy."""

from __future__ import annotations

import pytest
from support.engines import GREEDY, make_engine

from kvhive.config import SchedulerConfig, StoreConfig
from kvhive.core.retention import RetentionRange, RetentionSpec
from kvhive.request import SamplingParams

ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
BLOCK = 4
USABLE = 16


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 37 + i * 11) % 240 + 5 for i in range(n)]


def pinned(priority: int, duration_s: float | None = None) -> RetentionSpec:
    return RetentionSpec((RetentionRange(0, None, priority, duration_s),))


def run(engine, rid: str, tokens: list[int], retention: RetentionSpec | None = None, priority: int = 0,
        sampling: SamplingParams = ONE) -> int:
    """Run one request to the end; its cached prompt tokens."""
    engine.add_request(rid, tokens, sampling, retention=retention, priority=priority)
    cached = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                cached = out.num_cached_tokens
    engine.scheduler.kv.pool.check_integrity()
    return cached


def flood(engine, start: int) -> None:
    """Three one-off prompts of 6 blocks each: together more than the pool."""
    for k in range(3):
        run(engine, f"flood{start + k}", prompt(100 + start + k, 6 * BLOCK))


def test_a_high_priority_prefix_outlives_one_off_prompts_and_a_default_one_does_not(tokenizer):
    engine = make_engine(tokenizer, num_blocks=USABLE + 1, block_size=BLOCK)
    high, default = prompt(1, 4 * BLOCK), prompt(2, 4 * BLOCK)
    run(engine, "high", high, retention=pinned(90))
    run(engine, "default", default)
    flood(engine, 0)
    assert run(engine, "high-again", high + [9, 9]) == 4 * BLOCK
    assert run(engine, "default-again", default + [9, 9]) == 0
    engine.close()


def test_a_priority_falls_back_to_the_default_when_its_duration_ends(tokenizer):
    engine = make_engine(tokenizer, num_blocks=USABLE + 1, block_size=BLOCK)
    now = [1000.0]
    engine.scheduler.kv.pool.clock = lambda: now[0]
    short, long = prompt(3, 4 * BLOCK), prompt(4, 4 * BLOCK)
    run(engine, "short", short, retention=pinned(90, 10.0))
    run(engine, "long", long, retention=pinned(90, 1000.0))
    now[0] += 60
    flood(engine, 10)
    assert run(engine, "long-again", long + [9, 9]) == 4 * BLOCK
    assert run(engine, "short-again", short + [9, 9]) == 0
    engine.close()


def test_blocks_below_the_offload_min_priority_stay_out_of_the_cpu_tier(tokenizer):
    probe = make_engine(tokenizer)
    block_bytes = probe.block_bytes
    probe.close()
    engine = make_engine(tokenizer, store=StoreConfig(cpu_offload_gb=64 * block_bytes / 2**30,
                                                      offload_min_priority=50))
    run(engine, "default", prompt(5, 4 * BLOCK))
    run(engine, "high", prompt(6, 4 * BLOCK), retention=pinned(60))
    engine.connector_worker.wait_for_save()
    stats = engine.connector_scheduler.stats()
    assert stats.saved_blocks == 4 and stats.unsaved_low_priority == 4
    assert engine.stats().connector.unsaved_low_priority == 4          # /metrics reads this
    engine.close()


def test_scheduling_priority_needs_the_priority_policy(tokenizer):
    engine = make_engine(tokenizer)
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        engine.add_request("r", prompt(7, 8), GREEDY, priority=1)
    engine.close()


def test_under_the_priority_policy_lower_values_run_first(tokenizer):
    from support.tiny import tiny_config, tiny_model

    from kvhive.config import CacheConfig, EngineConfig
    from kvhive.engine.llm_engine import LLMEngine
    from kvhive.model.loader import LoadedModel

    cfg = tiny_config(max_position_embeddings=512, vocab_size=256)
    config = EngineConfig(model_path="tiny", cache=CacheConfig(block_size=BLOCK, num_blocks=64),
                          scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=512,
                                                    scheduling_policy="priority"))
    engine = LLMEngine(config, loaded=LoadedModel(cfg, tiny_model(cfg), "tiny-engine-test"), tokenizer=tokenizer)
    for rid, priority in (("late", 5), ("urgent", -1), ("normal", 0)):
        engine.add_request(rid, prompt(len(rid), 8), ONE, priority=priority)
    finished = []
    while engine.has_unfinished():
        finished += [out.request_id for out in engine.step() if out.finished]
    assert finished == ["urgent", "normal", "late"]
    engine.close()
