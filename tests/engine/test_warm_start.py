"""The warm-up forward passes a server runs before its first request (kvhive.engine.warm_start):
they change nothing a request can see."""

from __future__ import annotations

import torch
from support.engines import make_engine, make_engine_with_cpu_tier, run

from kvhive.engine import warm_start


def _prompts() -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(3)
    return {f"r{i}": torch.randint(3, 250, (n,), generator=gen).tolist() for i, n in enumerate((9, 30, 61))}


def test_warm_up_runs_and_leaves_tokens_cache_and_pool_accounting_as_they_were(tokenizer):
    cold = make_engine(tokenizer)
    expected = run(cold, _prompts())
    cold.close()

    engine = make_engine_with_cpu_tier(tokenizer, tier_blocks=32)     # a connector sees every layer
    calls = []
    real_execute = engine.runner.execute
    engine.runner.execute = lambda plan: calls.append(plan) or real_execute(plan)
    engine.warm_up()
    assert len(calls) == 2 and calls[1].seqs[0].num_new_tokens == 1 and calls[1].seqs[1].start_pos > 0
    engine.runner.execute = real_execute
    # Nothing scheduled, cached or held: the pool is as a fresh engine's.
    stats = engine.stats()
    assert stats.used_blocks == 0 and stats.cached_blocks == 0
    assert not engine.has_unfinished()
    assert all(s.bytes_in == 0 and s.used_bytes == 0 for s in engine.store.stats().values())
    assert run(engine, _prompts()) == expected
    engine.close()


def test_warm_up_is_skipped_where_the_pool_is_too_small(tokenizer):
    engine = make_engine(tokenizer, num_blocks=8, block_size=4)
    ran = []
    engine.runner.execute = lambda plan: ran.append(plan)
    assert warm_start.warm_up(engine.runner, 256) is False and not ran
    engine.close()
