"""The Messages API's server parts without a model: the body's bounds, the Anthropic headers, the
error rewriting on /v1/messages*, stop reasons and stop sequences, the content block events, and
the usage counters."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from pydantic import ValidationError
from starlette.datastructures import Headers

from kvhive.core.anthropic_errors import anthropic_error_type
from kvhive.core.tool_parsers import ArgumentsDelta, ContentDelta
from kvhive.engine.request_errors import TOO_COMPLEX, ConstraintTooComplex
from kvhive.server.errors import APIError, install_error_handlers
from kvhive.server.messages_errors import AnthropicErrors, check_anthropic_headers
from kvhive.server.messages_protocol import MessagesRequest
from kvhive.server.messages_stream import (
    BlockEvents,
    MessageAnswer,
    call_input,
    cut_stop_sequence,
    stop_reason,
)
from kvhive.server.prompt_cache import NO_PROMPT_CACHE
from kvhive.server.text_deltas import TextDelta
from kvhive.server.tool_output import CallBegun, OutputCall
from kvhive.server.tools import NO_PLAN

BODY = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}


# ---------------------------------------------------------------- bounds


@pytest.mark.parametrize(("field", "value"), [
    ("max_tokens", 0), ("temperature", 1.5), ("temperature", -0.1), ("top_p", 0), ("top_k", -1),
    ("stop_sequences", ["s"] * 17), ("stop_sequences", ["s" * 257]), ("metadata", {"user_id": "u" * 257}), ("metadata", {"name": "x"}),
    ("stream", "yes"), ("service_tier", "priority"), ("container", "c"), ("model", "m" * 300),
])
def test_fields_out_of_bounds_are_refused(field: str, value: Any) -> None:
    with pytest.raises(ValidationError):
        MessagesRequest.model_validate({**BODY, field: value})


def test_max_tokens_is_required_and_ints_are_floats() -> None:
    with pytest.raises(ValidationError):
        MessagesRequest.model_validate({k: v for k, v in BODY.items() if k != "max_tokens"})
    body = MessagesRequest.model_validate({**BODY, "temperature": 1, "top_k": 5, "metadata": {"user_id": "u"}})
    assert (body.temperature, body.top_k) == (1, 5)


# ---------------------------------------------------------------- headers


@pytest.mark.parametrize("headers", [
    {}, {"anthropic-version": "2023-06-01"}, {"anthropic-version": "2026-10-21"},
    {"anthropic-version": "2031-02-28"},
    {"anthropic-beta": "prompt-caching-2024-07-31, extended-cache-ttl-2025-04-11"},
])
def test_accepted_headers(headers: dict[str, str]) -> None:
    check_anthropic_headers(Headers(headers))


@pytest.mark.parametrize(("headers", "named"), [
    ({"anthropic-version": "latest"}, "malformed"),
    ({"anthropic-version": "2023-01-01"}, "unknown version"),
    ({"anthropic-version": "2027-13-01"}, "unknown version"),
    ({"anthropic-beta": "prompt-caching-2024-07-31,computer-use-2025-01-24"}, "computer-use-2025-01-24"),
    ({"anthropic-beta": ",".join(f"b{i}" for i in range(40))}, "at most"),
    ({"x-session-id": "sess-1"}, "x-session-id is not served"),
    ({"x-session-ttl": "600"}, "x-session-ttl is not served"),
])
def test_refused_headers_name_the_header(headers: dict[str, str], named: str) -> None:
    with pytest.raises(APIError) as info:
        check_anthropic_headers(Headers(headers))
    assert info.value.status_code == 400 and named in info.value.message
    assert info.value.param in ("anthropic-version", "anthropic-beta", *headers)


# ---------------------------------------------------------------- errors


def error_app() -> TestClient:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/messages")
    async def refuse() -> None:
        raise APIError(429, "slow down", type="rate_limit_error", param="x")

    @app.post("/v1/messages/count_tokens")
    async def crash() -> None:
        raise RuntimeError("boom")

    @app.post("/v1/chat/completions")
    async def chat() -> None:
        raise APIError(400, "bad", param="messages")

    @app.get("/v1/messages/fine")
    async def fine() -> JSONResponse:
        return JSONResponse({"ok": True})

    app.add_middleware(AnthropicErrors)
    return TestClient(app, raise_server_exceptions=False)


def test_errors_on_messages_paths_take_anthropics_shape() -> None:
    client = error_app()
    limited = client.post("/v1/messages")
    assert limited.status_code == 429
    assert limited.json() == {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down (x)"}}
    assert int(limited.headers["content-length"]) == len(limited.content)
    crashed = client.post("/v1/messages/count_tokens")
    assert crashed.status_code == 500 and crashed.json()["error"]["type"] == "api_error"
    assert "boom" in crashed.json()["error"]["message"]
    missing = client.get("/v1/messages/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    assert client.get("/v1/messages/fine").json() == {"ok": True}
    # Other paths keep OpenAI's shape.
    assert client.post("/v1/chat/completions").json()["error"]["param"] == "messages"


@pytest.mark.parametrize(("status", "kind"), [(400, "invalid_request_error"), (401, "authentication_error"),
                                              (404, "not_found_error"), (409, "invalid_request_error"),
                                              (413, "request_too_large"), (507, "api_error"),
                                              (503, "overloaded_error")])
def test_error_types_by_status(status: int, kind: str) -> None:
    assert anthropic_error_type(status) == kind


# ---------------------------------------------------------------- the answer


def test_a_stop_sequence_is_cut_and_named() -> None:
    assert cut_stop_sequence("hello wor", ["or", "wor", "zz"]) == ("hello ", "wor")
    assert cut_stop_sequence("hello", ["zz"]) == ("hello", None)
    assert stop_reason("length", None, True) == "max_tokens"
    assert stop_reason("stop", "wor", False) == "stop_sequence"
    assert stop_reason("stop", None, True) == "tool_use"
    assert stop_reason("stop", None, False) == "end_turn"


def test_text_then_a_call_make_two_blocks() -> None:
    call = OutputCall("call_abc", "get_weather")
    events = BlockEvents().events([ContentDelta("Let me "), ContentDelta("check."), CallBegun(0, call),
                                   ArgumentsDelta(0, '{"city": '), ArgumentsDelta(0, '"Paris"}')])
    frames = [json.loads(e.split("data: ", 1)[1]) for e in events]
    kinds = [(f["type"], f.get("index")) for f in frames]
    assert kinds == [("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0),
                     ("content_block_stop", 0), ("content_block_start", 1), ("content_block_delta", 1),
                     ("content_block_delta", 1)]
    assert frames[4]["content_block"] == {"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {}}
    assert "".join(f["delta"]["partial_json"] for f in frames[5:]) == '{"city": "Paris"}'


def test_call_arguments_nested_past_the_json_parsers_stack_stay_text() -> None:
    """A call whose arguments nest deeper than Python's JSON parser recurses is not a tool_use
    input (a text block holds it), not a server error."""
    deep = "[" * 5000 + "]" * 5000
    assert call_input(OutputCall("call_1", "f", [deep])) is None
    assert call_input(OutputCall("call_2", "f", ['{"a": [1]}'])) == {"a": [1]}


def test_the_whole_answer_and_its_usage_without_breakpoints() -> None:
    answer = MessageAnswer("m", NO_PLAN, 20, ("STOP",), NO_PROMPT_CACHE)
    result = TextDelta("It is sunnySTOP", "stop", num_prompt_tokens=20, num_cached_tokens=16, num_output_tokens=5)
    response = answer.response(result)
    assert [b.text for b in response.content] == ["It is sunny"]
    assert (response.stop_reason, response.stop_sequence) == ("stop_sequence", "STOP")
    # Without breakpoints the whole prompt is input, whatever the prefix cache served.
    assert response.usage.model_dump() == {"input_tokens": 20, "output_tokens": 5, "cache_creation_input_tokens": 0,
                                           "cache_read_input_tokens": 0}


def test_a_stream_that_fails_ends_with_an_error_event() -> None:
    async def failing() -> AsyncIterator[TextDelta]:
        yield TextDelta("Hel", None, num_prompt_tokens=3, num_cached_tokens=0, num_output_tokens=1)
        raise RuntimeError("engine died")

    async def collect() -> list[str]:
        answer = MessageAnswer("m", NO_PLAN, 3, (), NO_PROMPT_CACHE)
        return [event async for event in answer.events(failing())]

    events = asyncio.run(collect())
    names = [e.split("\n", 1)[0].removeprefix("event: ") for e in events]
    assert names == ["message_start", "ping", "content_block_start", "content_block_delta", "error"]
    error = json.loads(events[-1].split("data: ", 1)[1])
    assert error["error"]["type"] == "api_error" and "engine died" in error["error"]["message"]


def test_a_stream_its_constraint_ends_has_an_invalid_request_error_event() -> None:
    """The output's structured-output constraint ended it (the client's constraint, not a server
    fault): the stream's error event is a 400's."""
    async def refused() -> AsyncIterator[TextDelta]:
        yield TextDelta("{", None, num_prompt_tokens=3, num_cached_tokens=0, num_output_tokens=1)
        raise ConstraintTooComplex(f"{TOO_COMPLEX} Parser Error: Current row has 5001 items; max is 2000")

    async def collect() -> list[str]:
        answer = MessageAnswer("m", NO_PLAN, 3, (), NO_PROMPT_CACHE)
        return [event async for event in answer.events(refused())]

    error = json.loads(asyncio.run(collect())[-1].split("data: ", 1)[1])
    assert error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].endswith("limits at this point of the output: Parser Error: Current row has "
                                              "5001 items; max is 2000")
