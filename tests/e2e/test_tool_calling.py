"""Tool calling over real HTTP with the clients agents are written in: the ``openai`` SDK (chat
completions whole and streamed, the Responses API) and LangChain's ``ChatOpenAI.bind_tools``, on the
default model (whose template has no tool support: kvhive's own format) and on tiny random Qwen3,
Llama 3 and Mistral checkpoints with their published templates (Hermes ``<tool_call>``, Llama 3 JSON
and Mistral ``[TOOL_CALLS]`` calls).

The tiny models write noise, so the tests ask for ``required`` or named tool choices over tools whose
arguments are bounded (enums, short strings): the grammar, not the model, makes every call valid,
and every call's arguments are checked against its tool's parameters. One call per answer there
(``parallel_tool_calls`` false): a random model may go on adding calls until ``max_tokens``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import jsonschema
import pytest
from openai import OpenAI
from support.chat_models import tiny_chat_model
from support.cluster import ReplicaProcess, running_replicas
from support.servers import DEFAULT_API_KEY, start_server, stop_server

DEFAULT_MODEL = "smollm2-135m"
MAX_TOKENS = 400                         # a tiny model's vocabulary spends about 80 tokens on one call
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
    "units": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "units"], "additionalProperties": False}
NOTE = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 12}, "urgent": {"type": "boolean"}},
        "required": ["text", "urgent"], "additionalProperties": False}
PARAMETERS = {"get_weather": WEATHER, "add_note": NOTE}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                           "parameters": WEATHER, "strict": True}},
         {"type": "function", "function": {"name": "add_note", "description": "Save a short note.",
                                           "parameters": NOTE}}]
RESPONSES_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]
ASK = [{"role": "system", "content": "You can call tools."},
       {"role": "user", "content": "What is the weather in Paris? Use the tool."}]


def check_call(name: str, arguments: str) -> dict[str, Any]:
    """A call's arguments parsed and validated against its tool's parameters."""
    assert name in PARAMETERS, name
    parsed = json.loads(arguments)
    jsonschema.validate(parsed, PARAMETERS[name])
    return parsed


# ---------------------------------------------------------------- servers


@dataclass(frozen=True)
class Served:
    """A running server: its URL, its model's name and family."""

    url: str
    model: str
    family: str


# The tiny models' parser: named on the command line for one, picked from the template for the other.
TINY_PARSER_FLAG = {"qwen3": ("--tool-call-parser", "hermes"), "llama3": (), "mistral3": ()}


@pytest.fixture(scope="module", params=["default", "qwen3", "llama3", "mistral3"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One server at a time: the default model, then ``kvhive serve`` on tiny Qwen3 and Llama 3."""
    if request.param == "default":
        server = start_server("default", api_keys=(DEFAULT_API_KEY,), max_model_len=2048)
        try:
            yield Served(server.base_url, DEFAULT_MODEL, "default")
        finally:
            stop_server(server)
        return
    directory = tiny_chat_model(request.param, tmp_path_factory.mktemp(f"tiny-{request.param}"))
    name = f"tiny-{request.param}"
    replica = ReplicaProcess(extra_args=("--model", directory, "--served-model-name", name, "--max-model-len",
                                         "2048", "--api-key", DEFAULT_API_KEY, *TINY_PARSER_FLAG[request.param]))
    with running_replicas([replica]):
        yield Served(replica.url, name, request.param)


@pytest.fixture(scope="module")
def client(served: Served) -> OpenAI:
    return OpenAI(base_url=f"{served.url}/v1", api_key=DEFAULT_API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(served: Served) -> str:
    return served.model


# ---------------------------------------------------------------- chat completions


def test_required_calls_are_valid(client: OpenAI, model: str) -> None:
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=MAX_TOKENS, temperature=0.8, seed=1, n=2, parallel_tool_calls=False)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        check_call(call.function.name, call.function.arguments)


def test_parallel_calls_on_the_default_model(served: Served, client: OpenAI, model: str) -> None:
    if served.family != "default":
        pytest.skip("a random model may add calls until max_tokens")
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=MAX_TOKENS, temperature=0.8, seed=1, n=2)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            check_call(call.function.name, call.function.arguments)


def test_named_choice_makes_exactly_that_call(client: OpenAI, model: str) -> None:
    r = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, max_tokens=MAX_TOKENS, temperature=1.0, seed=3,
        tool_choice={"type": "function", "function": {"name": "add_note"}})
    (choice,) = r.choices
    (call,) = choice.message.tool_calls
    assert call.function.name == "add_note"
    check_call("add_note", call.function.arguments)
    assert choice.finish_reason == "tool_calls"


def test_streamed_calls_assemble_into_the_whole_answer(client: OpenAI, model: str) -> None:
    body = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=MAX_TOKENS,
                temperature=0, parallel_tool_calls=False)
    whole = client.chat.completions.create(**body).choices[0]
    calls: dict[int, dict[str, Any]] = {}
    content, finish = [], []
    for chunk in client.chat.completions.create(**body, stream=True):
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        if chunk.choices[0].finish_reason:
            finish.append(chunk.choices[0].finish_reason)
        for piece in delta.tool_calls or ():
            if piece.id is not None:
                assert piece.index not in calls and piece.type == "function" and piece.function.name
                calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
            calls[piece.index]["arguments"] += piece.function.arguments or ""
    assert finish == ["tool_calls"]
    assert "".join(content) == (whole.message.content or "")
    assert "<tool_call>" not in "".join(content)
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert len(calls) == 1                     # parallel_tool_calls false: one call
    check_call(calls[0]["name"], calls[0]["arguments"])


def test_streamed_choices_each_get_their_calls(client: OpenAI, model: str) -> None:
    calls: dict[tuple[int, int], dict[str, str]] = {}
    finish: dict[int, str] = {}
    for chunk in client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                                max_tokens=MAX_TOKENS, temperature=1.0, seed=5, n=2,
                                                parallel_tool_calls=False, stream=True):
        for choice in chunk.choices:
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
            for piece in choice.delta.tool_calls or ():
                call = calls.setdefault((choice.index, piece.index), {"name": "", "arguments": ""})
                call["name"] += piece.function.name or ""
                call["arguments"] += piece.function.arguments or ""
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    assert sorted(calls) == [(0, 0), (1, 0)]
    for call in calls.values():
        check_call(call["name"], call["arguments"])


def test_agent_loop_feeds_results_back(client: OpenAI, model: str) -> None:
    messages = list(ASK)
    prompt_tokens = []
    for turn in range(3):
        r = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="required",
                                           max_tokens=MAX_TOKENS, temperature=0, parallel_tool_calls=False)
        message = r.choices[0].message
        (call,) = message.tool_calls
        args = check_call(call.function.name, call.function.arguments)
        prompt_tokens.append(r.usage.prompt_tokens)
        messages.append(message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"turn": turn, **args})})
    final = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=8, temperature=0)
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # Each turn's call and result are in the next prompt (never dropped).
    assert prompt_tokens[0] < prompt_tokens[1] < prompt_tokens[2] < final.usage.prompt_tokens
    assert final.usage.prompt_tokens_details.cached_tokens > 0


def test_tool_choice_none_and_auto_answer(client: OpenAI, model: str) -> None:
    none = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="none",
                                          max_tokens=16, temperature=0)
    assert none.choices[0].message.tool_calls == [] and none.choices[0].finish_reason in ("stop", "length")
    auto = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=16, temperature=0)
    for call in auto.choices[0].message.tool_calls or ():
        json.loads(call.function.arguments or "{}")


# ---------------------------------------------------------------- the Responses API


def test_responses_function_calls_and_outputs(client: OpenAI, model: str) -> None:
    first = client.responses.create(model=model, input="What is the weather in Tokyo?", tools=RESPONSES_TOOLS,
                                    tool_choice="required", max_output_tokens=MAX_TOKENS, temperature=0,
                                    parallel_tool_calls=False)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and first.status == "completed"
    for call in calls:
        assert call.call_id.startswith("call_") and call.status == "completed"
        check_call(call.name, call.arguments)
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": '{"temp": 21}'} for c in calls]
    second = client.responses.create(model=model, previous_response_id=first.id, input=outputs,
                                     tools=RESPONSES_TOOLS, max_output_tokens=8, temperature=0)
    assert second.status in ("completed", "incomplete")
    assert second.usage.input_tokens > first.usage.input_tokens
    # The same turn with the history sent as input items instead of a stored response.
    inline = client.responses.create(
        model=model, store=False, tools=RESPONSES_TOOLS, max_output_tokens=8, temperature=0,
        input=[{"role": "user", "content": "What is the weather in Tokyo?"},
               *[{"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments}
                 for c in calls], *outputs])
    assert inline.status in ("completed", "incomplete")


def test_responses_stream_function_call_events(client: OpenAI, model: str) -> None:
    body = dict(model=model, input="Note that it rains.", tools=RESPONSES_TOOLS, max_output_tokens=MAX_TOKENS,
                temperature=0, tool_choice={"type": "function", "name": "add_note"})
    events = list(client.responses.create(**body, stream=True))
    kinds = [e.type for e in events]
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.item.type for e in added] == ["function_call"]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == deltas and done.item_id == added[0].item.id
    check_call("add_note", done.arguments)
    assert kinds[-1] == "response.completed"
    (item,) = events[-1].response.output
    assert item.type == "function_call" and item.name == "add_note" and item.arguments == deltas


# ---------------------------------------------------------------- LangChain


def test_langchain_bind_tools(served: Served, model: str) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=model, base_url=f"{served.url}/v1", api_key=DEFAULT_API_KEY,
                     temperature=0, max_tokens=MAX_TOKENS, max_retries=0)
    bound = llm.bind_tools([TOOLS[0]], tool_choice="get_weather")
    message = bound.invoke("What is the weather in Lima?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(call["args"], WEATHER)
    required = llm.bind_tools([TOOLS[0], TOOLS[1]], tool_choice="required",
                              parallel_tool_calls=False).invoke("Note this down.")
    assert required.tool_calls
    for each in required.tool_calls:
        jsonschema.validate(each["args"], PARAMETERS[each["name"]])


# ---------------------------------------------------------------- bad input


# Arguments nested past the body's bound (and past Python's JSON parser's stack).
DEEP_ARGUMENTS = "[" * 100_000 + "]" * 100_000
BAD_CHAT = [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{**TOOLS[0], "function": {**TOOLS[0]["function"], "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1]"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [{"type": "retrieval", "function": TOOLS[0]["function"]}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!", "parameters": WEATHER}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/loop"}},
        "$defs": {"loop": {"$ref": "#/$defs/loop"}}}}}], "tool_choice": "required"},
     "tools[0].function.parameters"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "call_x", "content": "1"}]},
     "messages[1].tool_call_id"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "not json"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP_ARGUMENTS}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
]


@pytest.mark.parametrize(("extra", "param"), BAD_CHAT)
def test_bad_tool_input_is_a_400_naming_the_field(served: Served, model: str,
                                                  extra: dict[str, Any], param: str) -> None:
    if served.family != "default":
        pytest.skip("checked once, on the default model")
    body = {"model": model, "messages": ASK, "max_tokens": 4, **extra}
    r = httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=120,
                   headers={"Authorization": f"Bearer {DEFAULT_API_KEY}"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    # The server goes on serving.
    ok = httpx.post(f"{served.url}/v1/chat/completions", timeout=120,
                    headers={"Authorization": f"Bearer {DEFAULT_API_KEY}"},
                    json={"model": model, "messages": ASK, "max_tokens": 2})
    assert ok.status_code == 200


BAD_RESPONSES = [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "input[0].call_id"),
    ({"tools": RESPONSES_TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": DEEP_ARGUMENTS}]},
     "input[0].arguments"),
]


@pytest.mark.parametrize(("extra", "param"), BAD_RESPONSES)
def test_bad_responses_tool_input_is_a_400(served: Served, model: str,
                                           extra: dict[str, Any], param: str) -> None:
    if served.family != "default":
        pytest.skip("checked once, on the default model")
    body = {"model": model, "input": "hi", "max_output_tokens": 4, **extra}
    r = httpx.post(f"{served.url}/v1/responses", json=body, timeout=120,
                   headers={"Authorization": f"Bearer {DEFAULT_API_KEY}"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
