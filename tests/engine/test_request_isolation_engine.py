"""One request never takes the others down, in process: a failure while computing one row (or one
step) fails only its requests on the engine (tiny model; hypothesis drives the sampling fields
through the server's validation into the engine), and the gateway app refuses hostile bodies and
fails in OpenAI's shape."""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from support.api import DEEP, LONE, assert_error, chat_body
from support.servers import (
    SERVED_MODEL_NAME,
)
from support.tiny import tiny_config, tiny_model

from kvhive.config import CacheConfig, EngineConfig, SchedulerConfig
from kvhive.core.generation_defaults import NO_DEFAULTS
from kvhive.core.tokenizer import Tokenizer
from kvhive.engine.async_engine import AsyncEngine
from kvhive.engine.llm_engine import MAX_FAILED_STEPS_IN_ROW, LLMEngine, RequestFailed, RequestOutput
from kvhive.model.loader import LoadedModel
from kvhive.request import MIN_SEED, SAMPLING_EPS, SEED_END, FinishReason, SamplingParams
from kvhive.server.protocol import CompletionRequest
from kvhive.server.sampling_fields import sampling_params_for

MODEL = SERVED_MODEL_NAME

# ---------------------------------------------------------------- the engine in process


def make_engine(tokenizer: Tokenizer) -> LLMEngine:
    cfg = tiny_config(max_position_embeddings=512)
    loaded = LoadedModel(cfg, tiny_model(cfg), "tiny-isolation-test")
    config = EngineConfig(model_path="tiny", cache=CacheConfig(block_size=4, num_blocks=128),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512))
    return LLMEngine(config, loaded=loaded, tokenizer=tokenizer)


class Poisoner:
    """Wraps a runner's ``sample_rows``: the logits rows of ``poisoned`` requests become NaN (a
    model gone numerically wrong for one sequence), so the real sampling code meets them."""

    def __init__(self, engine: LLMEngine) -> None:
        self.poisoned: set[str] = set()
        self.batches_seen: list[list[str]] = []
        sample_rows = engine.runner.sample_rows

        def poisoning(logits: torch.Tensor, seqs: list) -> list[int]:
            self.batches_seen.append([s.request_id for s in seqs])
            rows = [i for i, s in enumerate(seqs) if s.request_id in self.poisoned]
            if rows:
                logits = logits.clone()
                logits[rows, 3] = float("nan")
            return sample_rows(logits, seqs)

        engine.runner.sample_rows = poisoning


def run_to_end(engine: LLMEngine, max_steps: int = 500) -> dict[str, list[RequestOutput]]:
    """Step until nothing is unfinished; every output by request id. Steps must never raise."""
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        if not engine.has_unfinished():
            return outputs
    raise AssertionError("the engine did not finish its requests")


@pytest.fixture(scope="module")
def poisoned_engine(tokenizer: Tokenizer) -> Iterator[tuple[LLMEngine, Poisoner]]:
    engine = make_engine(tokenizer)
    yield engine, Poisoner(engine)
    engine.close()


_ids = itertools.count()
# Normal floats only: the CPU kernels set flush-to-zero in this process, and subnormals then read as 0.
TEMPERATURES = st.one_of(st.floats(0, 2, allow_subnormal=False), st.sampled_from([0.0, 1e-50, 1e-300, 1e-6, SAMPLING_EPS, 2.0]))
TOP_PS = st.one_of(st.floats(sys.float_info.min, 1, allow_subnormal=False), st.sampled_from([1e-50, 1e-300, 1e-6, SAMPLING_EPS, 1.0]))
FIELDS = st.fixed_dictionaries({}, optional={
    "temperature": TEMPERATURES, "top_p": TOP_PS,
    "top_k": st.one_of(st.integers(-1, 300), st.just(10**30)),
    "seed": st.one_of(st.integers(MIN_SEED, SEED_END - 1), st.integers(-2**70, 2**70),
                      st.sampled_from([MIN_SEED, SEED_END - 1, SEED_END, MIN_SEED - 1])),
    "max_tokens": st.integers(1, 6), "logprobs": st.integers(0, 20),
    "repetition_penalty": st.floats(1e-3, 10, allow_subnormal=False),
    "presence_penalty": st.floats(-2, 2, allow_subnormal=False),
    "frequency_penalty": st.floats(-2, 2, allow_subnormal=False),
    "min_p": st.floats(0, 1, allow_subnormal=False), "min_tokens": st.integers(0, 1),
    "logit_bias": st.dictionaries(st.integers(0, 255).map(str), st.floats(-100, 100, allow_subnormal=False),
                                  max_size=4)})


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=st.lists(st.tuples(FIELDS, st.booleans()), min_size=1, max_size=5))
def test_any_accepted_sampling_fields_finish_in_the_engine(
        poisoned_engine: tuple[LLMEngine, Poisoner], requests: list[tuple[dict[str, Any], bool]]) -> None:
    engine, poisoner = poisoned_engine
    expected: dict[str, tuple[SamplingParams, bool]] = {}
    for fields, poison in requests:
        try:
            body = CompletionRequest.model_validate({"model": MODEL, "prompt": "x", **fields})
        except ValidationError:
            assert not MIN_SEED <= fields.get("seed", 0) < SEED_END       # only the seed can be out of bounds
            continue
        params = sampling_params_for(body, body.max_tokens or 4, NO_DEFAULTS, engine.model_config.vocab_size,
                                     body.logprobs)
        request_id = f"h{next(_ids)}"
        if poison:
            poisoner.poisoned.add(request_id)
        engine.add_request(request_id, [5 + len(expected), 17, 29, 31, 8], params)
        expected[request_id] = (params, poison)
    outputs = run_to_end(engine)
    assert set(outputs) == set(expected)
    for request_id, outs in outputs.items():
        params, poison = expected[request_id]
        last = outs[-1]
        assert last.finished and not any(o.finished for o in outs[:-1])
        if poison:
            assert last.finish_reason is FinishReason.ERROR and "NaN" in (last.error or "")
            assert last.num_output_tokens == 0
            continue
        assert last.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), last.error
        assert 1 <= last.num_output_tokens <= params.max_tokens
        tokens = [t for o in outs for t in o.new_token_ids]
        assert len(tokens) == last.num_output_tokens and all(0 <= t < engine.model_config.vocab_size for t in tokens)
        if params.logprobs is not None:
            assert all(o.logprobs is not None and len(o.logprobs[0].top) == params.logprobs for o in outs if o.new_token_ids)
    assert engine.stats().num_running == 0 and engine.stats().num_waiting == 0


def test_a_poisoned_row_leaves_its_batch_as_it_would_have_been(poisoned_engine: tuple[LLMEngine, Poisoner]) -> None:
    engine, poisoner = poisoned_engine
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=2**64 - 1, ignore_eos=True)
    prompts = {"greedy": [11, 12, 13, 14, 15, 16], "seeded": [21, 22, 23, 24, 25], "poisoned": [31, 32, 33]}

    def run(names: list[str], tag: str) -> dict[str, list[RequestOutput]]:
        for name in names:
            engine.add_request(f"{name}-{tag}", prompts[name], seeded if name == "seeded" else greedy)
        return run_to_end(engine)

    alone = run(["greedy", "seeded"], "alone")
    poisoner.poisoned.add("poisoned-batch")
    poisoner.batches_seen.clear()
    batch = run(["greedy", "seeded", "poisoned"], "batch")
    assert any(len(seen) == 3 for seen in poisoner.batches_seen)      # sampled together, then row by row
    for name in ("greedy", "seeded"):
        assert [t for o in batch[f"{name}-batch"] for t in o.new_token_ids] == \
            [t for o in alone[f"{name}-alone"] for t in o.new_token_ids]
    failed = batch["poisoned-batch"][-1]
    assert failed.finish_reason is FinishReason.ERROR and failed.error and "sampling failed" in failed.error


def test_a_row_whose_logprobs_raise_fails_alone(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    import kvhive.engine.runner

    token_logprobs = kvhive.engine.runner.token_logprobs

    def faulty(logits: torch.Tensor, token_ids: list[int], num_top: list[int | None]) -> list[Any]:
        if 7 in num_top:
            raise RuntimeError("injected logprobs failure")
        return token_logprobs(logits, token_ids, num_top)

    monkeypatch.setattr(kvhive.engine.runner, "token_logprobs", faulty)
    engine = make_engine(tokenizer)
    for request_id, num_top in (("fine", 2), ("bad", 7), ("plain", None)):
        engine.add_request(request_id, [3, 4, 5, 6], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True,
                                                                    logprobs=num_top))
    outputs = run_to_end(engine)
    bad = outputs["bad"][-1]
    assert bad.finish_reason is FinishReason.ERROR and "injected logprobs failure" in (bad.error or "")
    assert not bad.new_token_ids and bad.num_output_tokens == 0      # its sampled token is not kept
    assert [len(o.logprobs[0].top) for o in outputs["fine"] if o.logprobs] == [2, 2, 2]
    assert outputs["plain"][-1].num_output_tokens == 3
    engine.close()


def test_a_failed_step_fails_its_requests_and_keeps_nothing(tokenizer: Tokenizer) -> None:
    engine = make_engine(tokenizer)
    prompt = list(range(40, 60))
    sampling = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    execute = engine.runner.execute
    failing: set[str] = set()

    def faulty_execute(plan):
        if any(s.request_id in failing for s in plan.seqs):
            raise RuntimeError("injected step failure")
        return execute(plan)

    engine.runner.execute = faulty_execute
    failing.add("bad")
    engine.add_request("bad", prompt, sampling)
    engine.add_request("neighbour", [7, 8, 9], sampling)
    outputs = run_to_end(engine)
    for request_id in ("bad", "neighbour"):             # one step: both fail
        (out,) = outputs[request_id]
        assert out.finish_reason is FinishReason.ERROR and "injected step failure" in (out.error or "")
    # The engine goes on; what the failed step computed never became a prefix-cache hit.
    engine.add_request("again", prompt, sampling)
    again = run_to_end(engine)["again"][-1]
    assert again.finish_reason is FinishReason.LENGTH and again.num_cached_tokens == 0
    # A forward that fails step after step is a broken engine: the step raises (the loop stops).
    for i in range(MAX_FAILED_STEPS_IN_ROW):
        failing.add(f"bad{i}")
        engine.add_request(f"bad{i}", prompt, sampling)
        if i < MAX_FAILED_STEPS_IN_ROW - 1:
            assert [o.finish_reason for o in engine.step()] == [FinishReason.ERROR]
    with pytest.raises(RuntimeError, match="injected step failure"):
        engine.step()
    engine.close()


def test_async_engine_fails_one_request_and_runs_on(tokenizer: Tokenizer) -> None:
    engine = make_engine(tokenizer)
    Poisoner(engine).poisoned.add("bad")
    async_engine = AsyncEngine(engine)
    async_engine.start()
    sampling = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)

    async def collect(request_id: str, prompt: list[int]) -> int:
        tokens = 0
        async for out in async_engine.generate(request_id, prompt, sampling):
            tokens += len(out.new_token_ids)
        return tokens

    async def scenario() -> list[Any]:
        return await asyncio.gather(collect("good", [1, 2, 3, 4]), collect("bad", [5, 6, 7]), return_exceptions=True)

    try:
        good, bad = asyncio.run(scenario())
        assert good == 30
        assert isinstance(bad, RequestFailed) and "NaN" in str(bad)
        assert async_engine.is_healthy
        assert asyncio.run(scenario())[0] == 30
    finally:
        async_engine.shutdown()


# ---------------------------------------------------------------- the gateway


def test_the_gateway_refuses_hostile_bodies_and_fails_in_openai_shape(tokenizer: Tokenizer) -> None:
    from kvhive.gateway.app import create_gateway_app
    from kvhive.gateway.gateway_config import GatewayConfig, ReplicaSpec

    # No replica needs to answer: these bodies are refused before one is chosen.
    app = create_gateway_app(GatewayConfig((ReplicaSpec("http://127.0.0.1:9"),)), tokenizer)

    async def crash(*_: Any, **__: Any) -> Any:
        raise RuntimeError("injected gateway failure")

    paths = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/context", "/v1/embeddings")

    async def scenario() -> tuple[list[httpx.Response], list[httpx.Response]]:
        async with app.router.lifespan_context(app), \
                httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                                  base_url="http://gw") as client:
            refused = []
            for path in paths:
                refused.append(await client.post(path, content=DEEP))
                refused.append(await client.post(path, content=json.dumps(chat_body(LONE)).encode()))
            app.state.gateway.choose = crash            # a bug of the gateway's own, on every route
            return refused, [await client.post(path, json=chat_body("hi")) for path in paths]

    refused, crashed = asyncio.run(scenario())
    for r in refused:
        param = None if "deeper than" in r.json()["error"]["message"] else "messages[0].content"
        assert_error(r, 400, param=param)
    for r in crashed:
        assert_error(r, 500, error_type="server_error", code="internal_server_error",
                     contains=("injected gateway failure",))
