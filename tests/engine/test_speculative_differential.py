"""Speculative decoding against plain decoding over randomly drawn engines and requests.

Each seed draws a speculative config (method, k, lookup lengths, draft sizing), an engine geometry
(block size, pool size small enough to preempt, step budget, batch size, prefix caching on or off),
one to four prompts that repeat themselves (so n-gram drafts are found, accepted and rejected), the
sampling (greedy or seeded, stop tokens, min_tokens, penalties, logprobs) and whether the requests
arrive together or one step apart; the speculative engine must emit exactly the plain engine's
tokens. On the tiny random Llama, and on tiny Gemma 2 and 3 checkpoints whose window layers keep a
pool of their own (the pools' invariants checked after the speculative run).
"""

from __future__ import annotations

import random

import pytest
from support.engines import make_engine, run
from support.families import hf_model, path_in, save_hf

from kvhive.config import CacheConfig, EngineConfig, SchedulerConfig
from kvhive.core.speculative_config import SpeculativeConfig
from kvhive.engine.llm_engine import LLMEngine
from kvhive.model.loader import LoadedModel, load_model
from kvhive.request import SamplingParams


def _spec(rng: random.Random) -> SpeculativeConfig:
    low = rng.randint(1, 3)
    return SpeculativeConfig(method=rng.choice(["ngram", "history"]), num_speculative_tokens=rng.randint(1, 10),
                             prompt_lookup_min=low, prompt_lookup_max=rng.randint(low, 5),
                             draft_sizing=rng.choice(["per_request", "step_cost"]))


def _prompts(rng: random.Random, vocab: int, most: int) -> dict[str, list[int]]:
    prompts = {}
    for i in range(rng.randint(1, 4)):
        motif = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 8))]
        prompts[f"r{i}"] = (motif * 8)[:rng.randint(1, most)] + [rng.randrange(3, vocab) for _ in range(rng.randint(0, 4))]
    return prompts


def _sampling(rng: random.Random, vocab: int) -> SamplingParams:
    kw: dict = {"max_tokens": rng.randint(1, 30), "ignore_eos": rng.random() < 0.5, "temperature": 0.0}
    if rng.random() < 0.3:
        kw["stop_token_ids"] = [rng.randrange(3, vocab) for _ in range(2)]
    if rng.random() < 0.3:
        kw["min_tokens"] = rng.randint(0, kw["max_tokens"])
    if rng.random() < 0.3:
        kw["repetition_penalty"] = rng.choice([1.1, 1.5])
    if rng.random() < 0.3:
        kw.update(presence_penalty=0.5, frequency_penalty=0.3)
    if rng.random() < 0.4:
        kw["logprobs"] = rng.choice([0, 1, 3])
    if rng.random() < 0.3:
        kw.update(temperature=0.8, seed=rng.randint(0, 99))
    return SamplingParams(**kw)


@pytest.mark.parametrize("seed", range(24))
def test_drafted_runs_emit_the_plain_tokens_on_the_tiny_llama(tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    spec = _spec(rng)
    block = rng.choice([4, 8, 16])
    geometry = {"num_blocks": rng.choice([10, 16, 24, 64]), "block_size": block,
                "budget": max(block, rng.choice([8, 16, 32, 64])), "max_seqs": rng.choice([1, 2, 4]),
                "prefix": rng.random() < 0.7}
    prompts, sampling, stagger = _prompts(rng, 250, 40), _sampling(rng, 250), rng.random() < 0.5
    outputs = {}
    for name, speculative in (("plain", None), ("drafted", spec)):
        engine = make_engine(tokenizer, speculative=speculative, **geometry)
        try:
            outputs[name] = {rid: got[0] for rid, got in run(engine, prompts, sampling, stagger=stagger).items()}
        finally:
            engine.close()
    assert outputs["drafted"] == outputs["plain"], (spec, geometry, sampling)


@pytest.fixture(scope="module")
def gemmas(tmp_path_factory) -> dict[str, LoadedModel]:
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("gemmas")
    return {family: load_model(save_hf(hf_model(family), path_in(root, family))) for family in ("gemma2", "gemma3_text")}


@pytest.mark.parametrize("seed", range(10))
def test_drafted_runs_over_a_window_pool_emit_the_plain_tokens(gemmas, tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    loaded = gemmas[rng.choice(sorted(gemmas))]
    spec = _spec(rng)
    block = rng.choice([4, 8, 16])
    cache = CacheConfig(block_size=block, num_blocks=rng.choice([16, 24, 48]), enable_prefix_caching=rng.random() < 0.7)
    scheduler = SchedulerConfig(max_num_seqs=rng.choice([1, 2, 3]), max_num_batched_tokens=max(block, rng.choice([8, 32, 64])),
                                max_model_len=512)
    prompts, stagger = _prompts(rng, 120, 60), rng.random() < 0.5
    sampling = SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=True, temperature=0.0,
                              logprobs=1 if rng.random() < 0.4 else None)
    outputs = {}
    for name, speculative in (("plain", None), ("drafted", spec)):
        engine = LLMEngine(EngineConfig(model_path="tiny", cache=cache, scheduler=scheduler, speculative=speculative),
                           loaded=loaded, tokenizer=tokenizer)
        try:
            assert engine.runner.window is not None
            outputs[name] = {rid: got[0] for rid, got in run(engine, prompts, sampling, stagger=stagger).items()}
            kv = engine.scheduler.kv
            kv.pool.check_integrity()
            kv.window.pool.check_integrity()
            assert kv.window.stats().num_used == 0 and kv.pool.stats().num_used == 0
        finally:
            engine.close()
    assert outputs["drafted"] == outputs["plain"], (spec, cache, scheduler)
