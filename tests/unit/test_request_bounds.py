"""Bounds in process: sampling fields within documented bounds (tiny temperatures and top_p sample
greedily, a bad row raises before any generator draws), the request schema's bounds, and the JSON
body limits (nesting depth, lone surrogates)."""

from __future__ import annotations

import json
import time

import pytest
import torch
from pydantic import ValidationError
from support.api import DEEP, LONE
from support.servers import (
    SERVED_MODEL_NAME,
)

from kvhive.core.json_body import (
    MAX_JSON_DEPTH,
    BodyError,
    MalformedJSON,
    load_json,
    lone_surrogate_param,
    nesting_exceeds,
)
from kvhive.engine.sampling import _filtered_probs, sample_tokens
from kvhive.request import MIN_SEED, SAMPLING_EPS, SEED_END, SamplingParams
from kvhive.server.chat_protocol import ChatCompletionRequest
from kvhive.server.protocol import CompletionRequest
from kvhive.sessions.registry import SessionError, SessionInvalid, check_session_id

MODEL = SERVED_MODEL_NAME

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


def test_masked_and_huge_finite_logits_are_not_bad_rows() -> None:
    masked = torch.randn(2, 50)
    masked[1, :49] = float("-inf")                   # a mask that leaves one token
    assert sample_tokens(masked, [SamplingParams(temperature=0)] * 2, [None] * 2)[1] == 49
    huge = torch.full((1, 50), 3e38)                 # every value finite, their sum is not
    huge[0, 7] = 3.3e38
    assert sample_tokens(huge, [SamplingParams(temperature=0)], [None]) == [7]


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
             "messages[0].content[0].text"), ({"metadata": {LONE: "v"}}, "metadata.a\\ud800b"), ([LONE], "[0]"), (LONE, None)]
    for data, param in cases:
        with pytest.raises(BodyError, match="lone surrogate") as caught:
            load_json(json.dumps(data).encode())
        assert caught.value.param == param
    assert lone_surrogate_param({"a": ["ok", {"b": "\udfff"}]}) == "a[1].b"
