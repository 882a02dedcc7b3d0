"""vLLM's sampling extras through the engine on the tiny random model: neutral values change no
greedy token, a penalty changes a repetitive greedy output exactly as a dense reference with
transformers' processors does, through chunked prefill, prefix-cache hits and preemption, batched
with requests that use none; min_tokens holds EOS back; logit_bias forces a token."""

from __future__ import annotations

import torch
from support.engines import GREEDY, make_engine, run, run_engine
from support.tiny import dense_logits
from transformers import RepetitionPenaltyLogitsProcessor

from kvhive.request import SamplingParams

PROMPTS = {"a": [5, 9, 14, 9, 5, 9, 14, 9, 5, 9, 14, 9, 5], "b": [7, 7, 30, 41, 7, 30, 41, 7, 30]}


def penalized(**extras: object) -> SamplingParams:
    return SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, **extras)


def dense_penalized_greedy(model, prompt: list[int], num_tokens: int, repetition: float, frequency: float) -> list[int]:
    """Greedy decoding by the dense forward with transformers' repetition penalty over prompt and
    output, then OpenAI's frequency penalty over the output."""
    ids = list(prompt)
    processor = RepetitionPenaltyLogitsProcessor(repetition)
    for _ in range(num_tokens):
        logits = processor(torch.tensor([ids]), dense_logits(model, ids)[-1:].clone())[0]
        for token in ids[len(prompt):]:
            logits[token] -= frequency
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def test_neutral_extras_change_no_greedy_token(tokenizer) -> None:
    plain = run(make_engine(tokenizer), PROMPTS)
    # Each of these takes the processing path (a copy of the logits) and changes nothing.
    neutral = penalized(logit_bias=((3, 0.0),), min_tokens=1, repetition_penalty=1.0, min_p=0.0)
    assert run(make_engine(tokenizer), PROMPTS, neutral) == plain


def test_penalties_match_the_dense_reference_batched_chunked_and_cached(tokenizer) -> None:
    engine = make_engine(tokenizer, budget=8)            # prompts prefill in chunks of up to 8 tokens
    model = engine.runner.model
    plain = run(engine, PROMPTS)
    assert any(len(set(tokens)) < len(tokens) for tokens, _ in plain.values()), "no repetition to penalize"
    params = penalized(repetition_penalty=1.8, frequency_penalty=0.7)
    expected = {rid: dense_penalized_greedy(model, p, 12, 1.8, 0.7) for rid, p in PROMPTS.items()}
    assert expected != {rid: tokens for rid, (tokens, _) in plain.items()}
    requests = {"a-pen": (PROMPTS["a"], params), "b-plain": (PROMPTS["b"], GREEDY), "b-pen": (PROMPTS["b"], params)}
    outputs = run_engine(engine, requests)               # prefix-cache hits on the prompts of the first run
    got = {rid: [t for out in outs for t in out.new_token_ids] for rid, outs in outputs.items()}
    assert outputs["a-pen"][-1].num_cached_tokens > 0
    assert got["a-pen"] == expected["a"] and got["b-pen"] == expected["b"]
    assert got["b-plain"] == plain["b"][0]
    engine.step()                                        # hands the runner the finished ids
    assert engine.runner.logits_processors.num_histories() == 0


def test_penalties_survive_preemption(tokenizer) -> None:
    params = penalized(repetition_penalty=1.8, frequency_penalty=0.7)
    engine = make_engine(tokenizer, num_blocks=12, block_size=4, prefix=False, max_seqs=4)
    model = engine.runner.model
    prompts = {f"r{i}": [5 + i, 9, 14, 9, 5 + i, 9, 14] for i in range(4)}
    outputs = run_engine(engine, {rid: (p, params) for rid, p in prompts.items()})
    assert engine.scheduler.num_preemptions > 0
    for rid, outs in outputs.items():
        assert [t for out in outs for t in out.new_token_ids] == dense_penalized_greedy(model, prompts[rid], 12, 1.8, 0.7)


def test_min_tokens_holds_eos_back_and_logit_bias_forces_a_token(tokenizer) -> None:
    engine = make_engine(tokenizer)
    eos = engine.eos_token_ids[0]
    forced_eos = SamplingParams(max_tokens=8, temperature=0.0, logit_bias=((eos, 100.0),))
    held = SamplingParams(max_tokens=8, temperature=0.0, logit_bias=((eos, 100.0),), min_tokens=3)
    outputs = run_engine(engine, {"eos": ([5, 9, 14], forced_eos), "held": ([5, 9, 14], held)})
    tokens = {rid: [t for out in outs for t in out.new_token_ids] for rid, outs in outputs.items()}
    assert tokens["eos"] == [eos]                         # the bias wins at once
    assert len(tokens["held"]) == 4 and tokens["held"][-1] == eos and eos not in tokens["held"][:3]
