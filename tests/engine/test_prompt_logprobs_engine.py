"""Prompt logprobs in the engine (tiny random model): over chunked prefill and a cached prefix, a long
chunk, preemption, and refused in a session; every value checked against the log-softmax of a dense
reference forward of the same weights."""

from __future__ import annotations

import random

import pytest
from support.engines import run_engine
from support.tiny import prompt_reference, tiny_config, tiny_model

from kvhive.config import CacheConfig, EngineConfig, SchedulerConfig
from kvhive.core.tokenizer import Tokenizer
from kvhive.engine.llm_engine import LLMEngine
from kvhive.engine.step import TokenLogprobs
from kvhive.model.llama import LlamaModel
from kvhive.model.loader import LoadedModel
from kvhive.request import SamplingParams


def assert_match_reference(values: tuple[TokenLogprobs, ...], prompt: list[int], model: LlamaModel,
                           num_top: int) -> None:
    ref = prompt_reference(model, prompt)
    assert [v.token_id for v in values] == prompt[1:]
    assert [v.logprob for v in values] == pytest.approx(
        [ref[i, t].item() for i, t in enumerate(prompt[1:])], abs=1e-3)
    for i, v in enumerate(values):
        top_values, top_ids = ref[i].topk(num_top)
        assert [t for t, _ in v.top] == top_ids.tolist()
        assert [x for _, x in v.top] == pytest.approx(top_values.tolist(), abs=1e-3)


def small_engine(tokenizer: Tokenizer, model: LlamaModel, budget: int, num_blocks: int = 64) -> LLMEngine:
    config = EngineConfig(model_path="tiny", cache=CacheConfig(block_size=4, num_blocks=num_blocks),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget,
                                                    max_model_len=512))
    return LLMEngine(config, loaded=LoadedModel(model.config, model, "tiny-prompt-logprobs"), tokenizer=tokenizer)


def test_engine_prompt_logprobs_over_chunks_and_a_cached_prefix(tokenizer: Tokenizer) -> None:
    config = tiny_config(max_position_embeddings=512)
    model = tiny_model(config)
    # 16 tokens a step: a 37-token prompt takes chunks of 16, 16 and 5; the last one, over 32
    # computed tokens, runs as decode rows (kvhive.engine.step_inputs.DECODE_ROWS_MAX).
    engine = small_engine(tokenizer, model, budget=16)
    rng = random.Random(5)
    prompt = [rng.randrange(3, 256) for _ in range(37)]
    plain = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    scored = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=4)
    # The first 32 tokens go into the prefix cache first; the scored request must not use them.
    first = run_engine(engine, {"warm": (prompt[:33], plain)})
    assert first["warm"][-1].num_cached_tokens == 0
    outputs = run_engine(engine, {"scored": (prompt, scored),
                                  "beside": ([rng.randrange(3, 256) for _ in range(7)], plain)})
    scored_outputs = outputs["scored"]
    assert scored_outputs[0].prompt_logprobs is not None
    assert all(out.prompt_logprobs is None for out in scored_outputs[1:])
    assert_match_reference(scored_outputs[0].prompt_logprobs, prompt, model, 4)
    assert scored_outputs[-1].num_cached_tokens == 0
    assert all(out.prompt_logprobs is None for out in outputs["beside"])
    # Its blocks were published all the same: the plain request after it hits them.
    again = run_engine(engine, {"again": (prompt, plain)})
    assert again["again"][-1].num_cached_tokens == 36
    # The generated tokens' logprobs are still there, and the same as without prompt logprobs.
    greedy = [t for out in again["again"] for t in out.new_token_ids]
    assert [t for out in scored_outputs for t in out.new_token_ids] == greedy


def test_engine_prompt_logprobs_of_a_long_chunk(tokenizer: Tokenizer) -> None:
    """One 300-token chunk: its logits are taken PROMPT_LOGPROBS_ROWS (256) rows at a time."""
    model = tiny_model(tiny_config(max_position_embeddings=512))
    engine = small_engine(tokenizer, model, budget=512, num_blocks=128)
    rng = random.Random(6)
    prompt = [rng.randrange(3, 256) for _ in range(300)]
    outputs = run_engine(engine, {"long": (prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))})
    assert_match_reference(outputs["long"][0].prompt_logprobs, prompt, model, 1)


def test_engine_prompt_logprobs_survive_preemption(tokenizer: Tokenizer) -> None:
    """A pool too small for two prompts: the later arrival is preempted mid-way and recomputed;
    each prompt token's logprob still goes out exactly once, and right."""
    config = tiny_config(max_position_embeddings=512)
    model = tiny_model(config)
    engine = small_engine(tokenizer, model, budget=8, num_blocks=16)
    rng = random.Random(8)
    prompts = {rid: [rng.randrange(3, 256) for _ in range(30)] for rid in ("a", "b")}
    sampling = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=2)
    outputs = run_engine(engine, {rid: (p, sampling) for rid, p in prompts.items()})
    assert engine.scheduler.num_preemptions > 0
    for rid, prompt in prompts.items():
        assert [out.prompt_logprobs is not None for out in outputs[rid]] == [True] + [False] * 7
        assert_match_reference(outputs[rid][0].prompt_logprobs, prompt, model, 2)


def test_engine_refuses_prompt_logprobs_in_a_session(tokenizer: Tokenizer) -> None:
    engine = small_engine(tokenizer, tiny_model(tiny_config(max_position_embeddings=512)), budget=16)
    with pytest.raises(ValueError, match="session"):
        engine.add_request("s", [5, 6, 7], SamplingParams(prompt_logprobs=0), session_id="sess")
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
