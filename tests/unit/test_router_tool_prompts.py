"""The gateway renders a chat request's tools, tool-call history and ``chat_template_kwargs`` into the
same token ids as the replica (``kvhive.server.chat.chat_prompt_token_ids``, called in-process), so
KV-aware routing scores agent requests by the blocks the replica will actually compute: through
templates that read ``tools`` (qwen3, llama3) and the default model's, which does not (kvhive's own
format). A body whose tools the replica refuses is refused by the gateway's renderer too (the
gateway then routes it by load)."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterator
from typing import Any

import pytest
from support.tokenizer_families import family_tokenizer

from kvhive.core.json_body import BodyError
from kvhive.core.tokenizer import Tokenizer
from kvhive.routing.prompts import PromptTokenizer, prompt_from_body
from kvhive.server.chat import chat_prompt_token_ids
from kvhive.server.chat_protocol import ChatCompletionRequest
from kvhive.server.errors import APIError
from kvhive.server.generation import GenerationService
from kvhive.server.tools import chat_functions, tool_choice, tool_plan

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "units": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
ASK = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Paris?"}]
CALLED = [*ASK,
          {"role": "assistant", "content": None, "tool_calls": [
              {"id": "call_1", "type": "function",
               "function": {"name": "get_weather", "arguments": '{"city": "Paris", "units": "c"}'}}]},
          {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
LONG_DOC = "Background notes. " + " ".join(f"word{i % 37} alpha beta" for i in range(120))
BODIES = {
    "tools offered": {"messages": ASK, "tools": [WEATHER, CLOCK]},
    "tools and their history": {"messages": CALLED, "tools": [WEATHER, CLOCK], "tool_choice": "auto",
                                "parallel_tool_calls": False},
    "history, tool_choice none": {"messages": CALLED, "tools": [WEATHER], "tool_choice": "none"},
    "history without tools": {"messages": CALLED},
    "required, template variables": {"messages": [{"role": "developer", "content": [
        {"type": "text", "text": "Use tools."}, {"type": "text", "text": LONG_DOC}]}, *CALLED[1:]],
        "tools": [WEATHER], "tool_choice": "required", "chat_template_kwargs": {"enable_thinking": False}},
}


class _Engine:
    """An engine that compiles every grammar (``tool_plan`` checks a required choice's spec)."""

    async def check_structured(self, _spec: object) -> None:
        return None


class _Replica:
    """What ``chat_prompt_token_ids`` reads of a replica's GenerationService."""

    encode_chat = GenerationService.encode_chat

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer


@pytest.fixture(scope="module", params=["qwen3", "llama3", "default"])
def tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return family_tokenizer(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def gateway(tokenizer: Tokenizer) -> Iterator[PromptTokenizer]:
    prompts = PromptTokenizer(tokenizer, chunk_chars=64)      # small chunks: the prefix store is used
    yield prompts
    prompts.close()


def replica_ids(tokenizer: Tokenizer, body: dict[str, Any]) -> list[int]:
    """The ids a replica's chat completion computes for ``body`` (its own prompt path)."""
    request = ChatCompletionRequest.model_validate({"model": "m", **copy.deepcopy(body)})
    functions = chat_functions(request.tools)

    async def ids() -> list[int]:
        plan = await tool_plan(_Engine(), tokenizer.chat_template, "auto", functions,  # type: ignore[arg-type]
                               tool_choice(request.tool_choice, functions, flat=False), request.parallel_tool_calls)
        return await chat_prompt_token_ids(_Replica(tokenizer), request.messages,  # type: ignore[arg-type]
                                           template_kwargs=request.chat_template_kwargs, plan=plan)
    return asyncio.run(ids())


@pytest.mark.parametrize("name", list(BODIES))
def test_the_gateway_renders_what_the_replica_renders(tokenizer: Tokenizer, gateway: PromptTokenizer,
                                                      name: str) -> None:
    body = BODIES[name]
    prompt = prompt_from_body(copy.deepcopy(body))
    assert prompt is not None
    expected = replica_ids(tokenizer, body)
    assert gateway.token_ids(prompt) == expected
    assert gateway.token_ids(prompt) == expected            # again, from the prefix store
    if body.get("tools"):
        # The tools are in the prompt: without them the ids differ.
        assert gateway.token_ids(prompt_from_body({**body, "tools": None})) != expected  # type: ignore[arg-type]


def test_template_variables_reach_the_template(tokenizer: Tokenizer, gateway: PromptTokenizer) -> None:
    body = {"messages": ASK, "tools": [WEATHER]}
    thinking = {**body, "chat_template_kwargs": {"enable_thinking": False}}
    ids = gateway.token_ids(prompt_from_body(thinking))  # type: ignore[arg-type]
    assert ids == replica_ids(tokenizer, thinking)
    reads_it = tokenizer.chat_template is not None and tokenizer.chat_template.reads("enable_thinking")
    assert (ids != gateway.token_ids(prompt_from_body(body))) == reads_it  # type: ignore[arg-type]


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": ASK, "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": ASK, "tools": [WEATHER, WEATHER]}, "tools[1]"),
    ({"messages": [*CALLED[:2], {**CALLED[2], "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{oops"}}]}]},
     "messages[2].tool_calls[0].function.arguments"),
    ({"messages": [*ASK, {"role": "tool", "tool_call_id": "nobody", "content": "x"}]}, "messages[2].tool_call_id"),
    ({"messages": ASK, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
])
def test_a_body_the_replica_refuses_is_not_rendered(tokenizer: Tokenizer, gateway: PromptTokenizer,
                                                    body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as replica:
        replica_ids(tokenizer, body)
    assert replica.value.param == param
    prompt = prompt_from_body(body)
    assert prompt is not None
    with pytest.raises(BodyError) as refused:            # the gateway then routes it by load
        gateway.pieces(prompt)
    assert refused.value.param == param


@pytest.mark.parametrize("body", [
    {"messages": ASK, "tools": {"type": "function"}},
    {"messages": ASK, "chat_template_kwargs": ["x"]},
    {"messages": [{**CALLED[2], "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {}}}]}]},
    {"messages": [{"role": "tool", "tool_call_id": 7, "content": "x"}]},
])
def test_a_body_of_the_wrong_shape_has_no_prompt(body: dict[str, Any]) -> None:
    assert prompt_from_body(body) is None
