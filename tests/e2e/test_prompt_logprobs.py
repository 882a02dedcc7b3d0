"""Prompt logprobs (``echo`` + ``logprobs`` on /v1/completions, for scoring): in the engine, over
chunked prefill and a cached prefix, and over real HTTP on the tiny server; every value checked
against the log-softmax of a dense reference forward of the same random weights."""

from __future__ import annotations

import random
import uuid

import httpx
import pytest
import torch
from support.api import MODEL
from support.engines import run_engine
from support.servers import read_sse
from support.tiny import dense_logits, tiny_config, tiny_model

from kvhive.config import CacheConfig, EngineConfig, SchedulerConfig
from kvhive.core.tokenizer import Tokenizer
from kvhive.engine.core import LLMEngine
from kvhive.engine.step import TokenLogprobs
from kvhive.model.llama import LlamaModel
from kvhive.model.loader import LoadedModel
from kvhive.request import SamplingParams
from kvhive.server.logprobs import token_string

GREEDY = {"temperature": 0, "ignore_eos": True}


def prompt_reference(model: LlamaModel, prompt: list[int]) -> torch.Tensor:
    """log P(prompt[i] | prompt[:i]) for i >= 1, as the dense forward gives it: [P - 1, vocab]."""
    return torch.log_softmax(dense_logits(model, prompt)[:-1], dim=-1)


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


# ---------------------------------------------------------------- engine


def small_engine(tokenizer: Tokenizer, model: LlamaModel, budget: int, num_blocks: int = 64) -> LLMEngine:
    config = EngineConfig(model_path="tiny", cache=CacheConfig(block_size=4, num_blocks=num_blocks),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget,
                                                    max_model_len=512))
    return LLMEngine(config, loaded=LoadedModel(model.config, model, "tiny-prompt-logprobs"), tokenizer=tokenizer)


def test_engine_prompt_logprobs_over_chunks_and_a_cached_prefix(tokenizer: Tokenizer) -> None:
    config = tiny_config(max_position_embeddings=512)
    model = tiny_model(config)
    # 16 tokens a step: a 37-token prompt takes chunks of 16, 16 and 5; the last one, over 32
    # computed tokens, runs as decode rows (kvhive.engine.runner.DECODE_ROWS_MAX).
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


# ---------------------------------------------------------------- HTTP


@pytest.fixture(scope="module")
def reference(tokenizer: Tokenizer) -> LlamaModel:
    """The tiny server's model (same config and seed as tests/conftest.py builds it)."""
    return tiny_model(tiny_config(vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_ids=tokenizer.eos_token_ids))


def unique_prompt() -> str:
    """A prompt no other test sent: its blocks start out uncached on the shared server."""
    return f"Score this sentence {uuid.uuid4().hex} about the weather in Paris today."


def completion(client: httpx.Client, **fields) -> dict:
    r = client.post("/v1/completions", json={"model": MODEL, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def assert_prompt_part(lp: dict, text: str, prompt_ids: list[int], tokenizer: Tokenizer,
                       model: LlamaModel, num_top: int) -> None:
    """The first len(prompt_ids) entries of a choice's logprobs are the prompt's, right."""
    n = len(prompt_ids)
    assert lp["tokens"][:n] == [token_string(tokenizer.token_bytes(t)) for t in prompt_ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = prompt_reference(model, prompt_ids)
    assert lp["token_logprobs"][1:n] == pytest.approx(
        [ref[i, t].item() for i, t in enumerate(prompt_ids[1:])], abs=1e-3)
    for i in range(1, n):
        top = lp["top_logprobs"][i]
        ids = ref[i - 1].topk(num_top).indices.tolist()
        assert set(top) == {token_string(tokenizer.token_bytes(t)) for t in [*ids, prompt_ids[i]]}
        assert top[lp["tokens"][i]] == pytest.approx(lp["token_logprobs"][i], abs=1e-6)
    # Offsets into the echoed text: each (ASCII) token's text starts there.
    assert lp["text_offset"][:n] == sorted(lp["text_offset"][:n])
    for token, offset in zip(lp["tokens"][:n], lp["text_offset"][:n], strict=True):
        assert text[offset:].startswith(token)


def test_echo_logprobs_score_the_prompt_cached_or_not(tiny_client: httpx.Client, tokenizer: Tokenizer,
                                                      reference: LlamaModel) -> None:
    prompt = unique_prompt()
    ids = tokenizer.encode(prompt)
    scored = {"prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 3, **GREEDY}
    cold = completion(tiny_client, **scored)
    completion(tiny_client, prompt=prompt, max_tokens=1)       # now its blocks are cached
    warm = completion(tiny_client, **scored)
    for body in (cold, warm):
        (choice,) = body["choices"]
        assert choice["text"].startswith(prompt)
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 3
        assert_prompt_part(lp, choice["text"], ids, tokenizer, reference, 2)
        # Then the generated tokens, their offsets past the echoed prompt.
        assert "".join(lp["tokens"][len(ids):]) == choice["text"][len(prompt):]
        assert lp["text_offset"][len(ids)] == len(prompt)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert body["usage"]["completion_tokens"] == 3
    assert warm["choices"][0]["logprobs"] == cold["choices"][0]["logprobs"]
    # A plain request still finds the blocks in the cache.
    again = completion(tiny_client, prompt=prompt, max_tokens=1)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_max_tokens_zero_with_echo_returns_only_the_scored_prompt(tiny_client: httpx.Client, tokenizer: Tokenizer,
                                                                  reference: LlamaModel) -> None:
    prompt = unique_prompt()
    ids = tokenizer.encode(prompt)
    body = completion(tiny_client, prompt=prompt, echo=True, logprobs=0, max_tokens=0)
    (choice,) = body["choices"]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    assert_prompt_part(choice["logprobs"], prompt, ids, tokenizer, reference, 0)
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(ids)
    # Token ids in, without logprobs: the echoed text alone.
    plain = completion(tiny_client, prompt=ids, echo=True, max_tokens=0)
    assert plain["choices"][0]["text"] == tokenizer.decode(ids, skip_special_tokens=False)
    assert plain["choices"][0]["logprobs"] is None
    # A one-token prompt: its one entry is null, whole or streamed.
    one = completion(tiny_client, prompt=ids[:1], echo=True, logprobs=1, max_tokens=0)["choices"][0]["logprobs"]
    assert one["token_logprobs"] == [None] and one["top_logprobs"] == [None] and one["text_offset"] == [0]
    with tiny_client.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": ids[:1], "echo": True,
                                                             "logprobs": 1, "max_tokens": 0, "stream": True}) as r:
        first = read_sse(r)[0]["choices"][0]["logprobs"]
    assert first == one


def test_streamed_echo_logprobs_come_first_with_the_echo(tiny_client: httpx.Client) -> None:
    prompt = unique_prompt()
    for max_tokens in (0, 4):
        fields = {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": max_tokens, **GREEDY}
        whole = completion(tiny_client, **fields)["choices"][0]
        with tiny_client.stream("POST", "/v1/completions",
                                json={"model": MODEL, "stream": True, **fields}) as r:
            assert r.status_code == 200
            events = read_sse(r)
        assert events[-1] == "[DONE]"
        chunks = [e["choices"][0] for e in events[:-1]]
        assert chunks[0]["text"] == prompt
        assert chunks[0]["logprobs"]["token_logprobs"][0] is None
        assert "".join(c["text"] for c in chunks) == whole["text"]
        assert chunks[-1]["finish_reason"] == whole["finish_reason"]
        for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            streamed = [x for c in chunks if c["logprobs"] for x in c["logprobs"][field]]
            assert streamed == whole["logprobs"][field]


def test_prompt_logprobs_are_refused_in_a_session_and_without_echo_max_tokens_zero(
        tiny_client: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "Score me", "echo": True, "logprobs": 1, "max_tokens": 1}
    refused = [tiny_client.post("/v1/context", json=body, headers={"x-session-ttl": "60"}),
               tiny_client.post("/v1/completions", json=body, headers={"x-session-id": "no-such-session"})]
    for r in refused:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "logprobs" and "session" in r.json()["error"]["message"]
    r = tiny_client.post("/v1/completions", json={**body, "echo": False, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    # The same request outside a session is fine.
    assert tiny_client.post("/v1/completions", json=body).status_code == 200
