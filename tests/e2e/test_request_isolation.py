"""One request never takes the others down: sampling fields within documented bounds, a failure
while computing one row (or one step) fails only its requests, hostile bodies are OpenAI-shaped
4xx that store nothing, and a dead engine loop makes the server process exit non-zero.

Unit tests first, then the engine in process on the tiny model (hypothesis drives the sampling
fields through the server's validation into the engine), then real servers over HTTP (the shared
``--faulty`` tiny server; one server of its own for the dead loop) and the gateway app in process.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from support.api import assert_error
from support.servers import (
    LOOP_FAULT_MARKER,
    ROW_FAULT_MARKER,
    STEP_FAULT_MARKER,
    TINY_API_KEY,
    ServerProcess,
    read_sse,
    start_server,
    stop_server,
)
from support.tiny import tiny_config, tiny_model

from kvhive.config import CacheConfig, EngineConfig, SchedulerConfig
from kvhive.core.json_body import (
    MAX_JSON_DEPTH,
    BodyError,
    MalformedJSON,
    load_json,
    lone_surrogate_param,
    nesting_exceeds,
)
from kvhive.core.model_files import default_model_path
from kvhive.core.tokenizer import Tokenizer
from kvhive.engine.async_engine import AsyncEngine
from kvhive.engine.core import MAX_FAILED_STEPS_IN_ROW, LLMEngine, RequestFailed, RequestOutput
from kvhive.engine.sampling import _filtered_probs, sample_tokens
from kvhive.model.loader import LoadedModel
from kvhive.request import MIN_SEED, SAMPLING_EPS, SEED_END, FinishReason, SamplingParams
from kvhive.server.app import ENGINE_FAILURE_EXIT_S
from kvhive.server.protocol import ChatCompletionRequest, CompletionRequest
from kvhive.server.serving import GenerationService
from kvhive.sessions.registry import SessionError, SessionInvalid, check_session_id

MODEL = "smollm2-135m"
DEEP = b"[" * 100_000
# Lone surrogates as JSON escapes: json.dumps writes them so (ensure_ascii), as a client's bytes.
LONE = "a\ud800b"

# ---------------------------------------------------------------- unit: bounds


def test_sampling_params_bounds() -> None:
    for seed in (MIN_SEED, -1, 0, 2**63, SEED_END - 1):
        assert SamplingParams(seed=seed).seed == seed
    for seed in (MIN_SEED - 1, SEED_END):
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(seed=seed)
    for temperature in (float("nan"), float("inf"), -1e-9):
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=temperature)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=float("nan"))
    # Below SAMPLING_EPS, temperature and top_p sample greedily; at it, they sample.
    assert SamplingParams(temperature=1e-50).greedy and SamplingParams(top_p=1e-50).greedy
    assert not SamplingParams(temperature=SAMPLING_EPS).greedy and not SamplingParams(top_p=SAMPLING_EPS).greedy


def test_request_schema_bounds() -> None:
    base = {"model": MODEL, "prompt": "x"}
    for seed in (MIN_SEED, SEED_END - 1):
        assert CompletionRequest.model_validate({**base, "seed": seed}).seed == seed
    for field, value in [("seed", SEED_END), ("seed", MIN_SEED - 1), ("temperature", 2.0001), ("temperature", -0.1),
                         ("top_p", 0), ("top_p", 1.5), ("top_k", -2)]:
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate({**base, field: value})
    chat = {"model": MODEL, "messages": []}
    for good in ("conv-1", "a.b:c_d-e", "x" * 128):
        assert ChatCompletionRequest.model_validate({**chat, "conversation_id": good}).conversation_id == good
    for bad in ("", "会话-1", "a\r\nb", "abc\n", "has space", "x" * 129, "a/b"):
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate({**chat, "conversation_id": bad})
    check_session_id("sess-0123abcd", "x-session-id")
    with pytest.raises(SessionError) as caught:
        check_session_id("bad id", "x-session-id")
    assert isinstance(caught.value, SessionInvalid) and caught.value.param == "x-session-id"


def test_tiny_temperature_and_top_p_sample_greedily() -> None:
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=1e-50), SamplingParams(top_p=1e-50), SamplingParams(temperature=1e-6, top_p=1e-300)]
    assert sample_tokens(logits, params, [None] * 3) == logits.argmax(dim=-1).tolist()
    # A top_p that rounds to 0 in float32 still keeps the top token (never an all-zero row).
    probs = _filtered_probs(logits, [SamplingParams(top_p=1e-50)] * 3)
    assert torch.equal(probs.argmax(dim=-1), logits.argmax(dim=-1)) and torch.all(probs.sum(dim=-1) > 0.99)


def test_a_bad_row_raises_before_any_generator_draws() -> None:
    logits = torch.randn(3, 50)
    gen = torch.Generator().manual_seed(7)
    before = gen.get_state()
    for poison in (float("nan"), float("inf")):
        bad = logits.clone()
        bad[2, 5] = poison
        with pytest.raises(ValueError, match="row 2"):
            sample_tokens(bad, [SamplingParams(seed=7)] * 3, [gen, None, None])
        assert torch.equal(gen.get_state(), before)
    with pytest.raises(ValueError, match="row 1"):
        sample_tokens(torch.stack([logits[0], torch.full((50,), float("-inf"))]), [SamplingParams()] * 2, [None] * 2)


# ---------------------------------------------------------------- unit: JSON bodies


def test_json_nesting_limit() -> None:
    assert not nesting_exceeds(b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH)
    assert nesting_exceeds(b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1))
    # Brackets inside strings (escaped quotes too) are text, not nesting.
    text = json.dumps({"prompt": "[" * 500 + '"{' * 100, "stop": ["]]"]}).encode()
    assert not nesting_exceeds(text) and load_json(text)["stop"] == ["]]"]
    assert load_json(json.dumps({"a": [[{"b": [1]}]] * 100}).encode())["a"][99] == [{"b": [1]}]
    started = time.perf_counter()
    for raw in (DEEP, b'{"a":' * 100_000, b"[" * 50_000 + b"]" * 50_000):
        with pytest.raises(BodyError, match="deeper than") as caught:
            load_json(raw)
        assert not isinstance(caught.value, MalformedJSON)
    assert time.perf_counter() - started < 1.0


def test_json_values_and_unicode() -> None:
    for raw in (b'{"temperature": NaN}', b'{"t": Infinity}', b'{"t": -Infinity}', b"\xff\xfe", b'{"a": 1',
                b'{"p": "\xed\xa0\x80"}', b'{"n": ' + b"9" * 5000 + b"}"):
        with pytest.raises(MalformedJSON):
            load_json(raw)
    assert load_json(json.dumps({"p": "😀 é"}).encode())["p"] == "😀 é"           # a valid pair passes
    cases = [({"prompt": LONE}, "prompt"), ({"messages": [{"role": "user", "content": [{"text": LONE}]}]},
             "messages[0].content[0].text"), ({"metadata": {LONE: "v"}}, f"metadata.{LONE}"), ([LONE], "[0]"), (LONE, None)]
    for data, param in cases:
        with pytest.raises(BodyError, match="lone surrogate") as caught:
            load_json(json.dumps(data).encode())
        assert caught.value.param == param
    assert lone_surrogate_param({"a": ["ok", {"b": "\udfff"}]}) == "a[1].b"


# ---------------------------------------------------------------- the engine in process


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_model_path(default_model_path())


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
    "max_tokens": st.integers(1, 6), "logprobs": st.integers(0, 20)})


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
        params = GenerationService.sampling_params(body, body.max_tokens or 4, body.logprobs)
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


# ---------------------------------------------------------------- over HTTP: the shared faulty tiny server


def greedy_answer(client: httpx.Client) -> str:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "The same question", "max_tokens": 8,
                                             "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def session_ids(client: httpx.Client) -> set[str]:
    r = client.get("/v1/context")
    assert r.status_code == 200, r.text
    return {s["id"] for s in r.json()["data"]}


def post_raw(client: httpx.Client, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    """POST ``body`` as JSON with its lone surrogates escaped, as json.dumps writes them."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(path, content=content, headers={"Content-Type": "application/json", **(headers or {})})


def chat_body(content: Any, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}


ROUTES = {
    "/v1/completions": lambda text, **extra: {"model": MODEL, "prompt": text, "max_tokens": 2, **extra},
    "/v1/chat/completions": chat_body,
    "/v1/responses": lambda text, **extra: {"model": MODEL, "input": text, "max_output_tokens": 2,
                                            **extra},
    "/v1/context": lambda text, **extra: {"model": MODEL, "prompt": text, "max_tokens": 2, **extra},
}


def answer_text(path: str, r: httpx.Response) -> str:
    assert r.status_code == 200, (path, r.text)
    data = r.json()
    if path == "/v1/responses":
        return data["output"][0]["content"][0]["text"]
    choice = data["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def test_edge_sampling_values_answer_like_greedy_on_every_route(tiny_client: httpx.Client) -> None:
    before = session_ids(tiny_client)
    for path, body in ROUTES.items():
        greedy = answer_text(path, post_raw(tiny_client, path, body("Tell me", temperature=0)))
        for extra in ({"temperature": 1e-50}, {"top_p": 1e-50}, {"temperature": 1, "top_p": 1e-300},
                      {"temperature": 2, "top_p": 1e-6}):
            assert answer_text(path, post_raw(tiny_client, path, body("Tell me", **extra))) == greedy, extra
    for sid in session_ids(tiny_client) - before:
        assert tiny_client.delete(f"/v1/context/{sid}").status_code == 200


def test_seed_bounds_on_every_route(tiny_client: httpx.Client) -> None:
    reference = greedy_answer(tiny_client)
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/context"):
        for seed in (SEED_END, MIN_SEED - 1, 10**40):
            assert_error(post_raw(tiny_client, path, ROUTES[path]("hi", temperature=1, seed=seed)), 400, param="seed")
    before = session_ids(tiny_client)
    for seed in (SEED_END - 1, MIN_SEED, -1):
        body = ROUTES["/v1/completions"]("hi", temperature=1, seed=seed, max_tokens=6)
        first, second = (post_raw(tiny_client, "/v1/completions", body) for _ in range(2))
        assert first.status_code == 200 and first.json()["choices"] == second.json()["choices"]
    assert session_ids(tiny_client) == before
    assert greedy_answer(tiny_client) == reference


def test_lone_surrogates_are_400s_naming_the_field(tiny_client: httpx.Client) -> None:
    reference = greedy_answer(tiny_client)
    before = session_ids(tiny_client)
    cases = [
        ("/v1/completions", ROUTES["/v1/completions"](LONE), "prompt"),
        ("/v1/completions", ROUTES["/v1/completions"]("hi", stop=["x", LONE]), "stop[1]"),
        ("/v1/chat/completions", chat_body(LONE), "messages[0].content"),
        ("/v1/chat/completions", chat_body([{"type": "text", "text": LONE}]), "messages[0].content[0].text"),
        ("/v1/chat/completions", chat_body("hi", conversation_id="c-1", user=LONE), "user"),
        ("/v1/responses", ROUTES["/v1/responses"](LONE), "input"),
        ("/v1/responses", ROUTES["/v1/responses"]([{"role": "user", "content": LONE}]), "input[0].content"),
        ("/v1/responses", ROUTES["/v1/responses"]("hi", instructions=LONE), "instructions"),
        ("/v1/context", ROUTES["/v1/context"](LONE), "prompt"),
        ("/v1/context", chat_body(LONE), "messages[0].content"),
    ]
    for path, body, param in cases:
        r = post_raw(tiny_client, path, body)
        assert_error(r, 400, param=param, contains=("Invalid Unicode", "lone surrogate"))
    assert session_ids(tiny_client) == before
    assert greedy_answer(tiny_client) == reference


def test_deep_nesting_is_a_400_on_every_post_route(tiny_client: httpx.Client) -> None:
    reference = greedy_answer(tiny_client)
    before = session_ids(tiny_client)
    sid = post_raw(tiny_client, "/v1/context", ROUTES["/v1/context"]("hold this")).headers["x-session-id"]
    head = b'{"model": "%s", "prompt": "x", "user": ' % MODEL.encode()
    for path in ROUTES:
        for body in (DEEP, head + b"[" * 100_000, head + b"[" * 70 + b"]" * 70 + b"}"):
            assert_error(post_raw(tiny_client, path, body), 400, contains=("deeper than",))
    assert_error(tiny_client.patch(f"/v1/context/{sid}", content=DEEP), 400, contains=("deeper than",))
    assert tiny_client.delete(f"/v1/context/{sid}").status_code == 200
    assert session_ids(tiny_client) == before
    assert greedy_answer(tiny_client) == reference


def test_bad_session_ids_are_400s_that_create_nothing(tiny_client: httpx.Client) -> None:
    reference = greedy_answer(tiny_client)
    before = session_ids(tiny_client)
    for conversation_id in ("会话-1", "a\r\nb", "bad\nid", "", "x" * 129, "has space", "a/b"):
        for stream in (False, True):
            r = post_raw(tiny_client, "/v1/chat/completions", chat_body("hi", conversation_id=conversation_id,
                                                                        stream=stream))
            assert_error(r, 400, param="conversation_id")
    for header in (b"has space", b"x" * 129, "\u00e9t\u00e9".encode("latin-1"), "会话".encode()):
        r = tiny_client.post("/v1/completions", json=ROUTES["/v1/completions"]("hi"), headers={"x-session-id": header})
        assert_error(r, 400, param="x-session-id", code="invalid_session_id")
    assert session_ids(tiny_client) == before
    assert greedy_answer(tiny_client) == reference


def test_a_faulted_row_fails_only_its_request(tiny_server: ServerProcess, tiny_client: httpx.Client) -> None:
    reference = greedy_answer(tiny_client)
    long = {"model": MODEL, "prompt": "Keep going", "max_tokens": 300, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    faulted = {"model": MODEL, "prompt": f"A {ROW_FAULT_MARKER} here", "max_tokens": 4}
    with tiny_client.stream("POST", "/v1/completions", json=long) as running:
        lines = running.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        r = tiny_client.post("/v1/completions", json=faulted)
        assert_error(r, 500, error_type="server_error", code="internal_server_error",
                     contains=("injected row failure",))
        rest = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert rest[-1]["usage"]["completion_tokens"] == 300
    assert "retrying row by row" in tiny_server.log_tail(200_000)       # they were sampled in one batch
    # Streamed, the failure is an error event; chat and responses fail the same way.
    with tiny_client.stream("POST", "/v1/completions", json={**faulted, "stream": True}) as r:
        events = read_sse(r)
    assert events[-1] == "[DONE]" and "injected row failure" in events[-2]["error"]["message"]
    chat = tiny_client.post("/v1/chat/completions", json=chat_body(ROW_FAULT_MARKER))
    assert_error(chat, 500, error_type="server_error", code="internal_server_error")
    response = tiny_client.post("/v1/responses", json=ROUTES["/v1/responses"](ROW_FAULT_MARKER))
    assert_error(response, 500, error_type="server_error", code="internal_server_error")
    assert greedy_answer(tiny_client) == reference


def test_a_failed_step_is_a_500_and_the_server_goes_on(tiny_server: ServerProcess, tiny_client: httpx.Client) -> None:
    reference = greedy_answer(tiny_client)
    for _ in range(4):                           # more than MAX_FAILED_STEPS_IN_ROW, each step apart
        r = tiny_client.post("/v1/completions", json={"model": MODEL, "prompt": STEP_FAULT_MARKER, "max_tokens": 2})
        assert_error(r, 500, error_type="server_error", code="internal_server_error",
                     contains=("injected step failure",))
        assert greedy_answer(tiny_client) == reference
    assert httpx.get(f"{tiny_server.base_url}/health").status_code == 200


# ---------------------------------------------------------------- a dead engine loop


def test_a_dead_engine_loop_exits_the_process_non_zero() -> None:
    server = start_server("tiny", api_keys=(TINY_API_KEY,), max_model_len=256, faulty=True)
    try:
        with httpx.Client(base_url=server.base_url, timeout=30,
                          headers={"Authorization": f"Bearer {TINY_API_KEY}"}) as client:
            r = client.post("/v1/completions", json={"model": MODEL, "prompt": LOOP_FAULT_MARKER, "max_tokens": 2})
            died = time.monotonic()
            assert_error(r, 500, error_type="server_error", code="internal_server_error",
                         contains=("injected engine loop failure",))
            try:
                health = client.get("/health", timeout=2)
                assert health.status_code == 503, health.text
            except httpx.TransportError:
                pass                             # the HTTP server has already stopped
        code = server.process.wait(timeout=ENGINE_FAILURE_EXIT_S + 5)
        assert code == 1, server.log_tail()
        assert time.monotonic() - died < ENGINE_FAILURE_EXIT_S + 1, server.log_tail()
    finally:
        stop_server(server)


# ---------------------------------------------------------------- the gateway


def test_the_gateway_refuses_hostile_bodies_and_fails_in_openai_shape(tokenizer: Tokenizer) -> None:
    from kvhive.router.app import create_gateway_app
    from kvhive.router.config import GatewayConfig, ReplicaSpec

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
