"""Anthropic's Messages API over real HTTP with the ``anthropic`` SDK (one tiny-model server, two API
keys, a disk dir): text, system, multi-turn, streaming events, stop sequences, tools through a
tool_use / tool_result round trip, count_tokens, Anthropic's error shapes and headers, and
``cache_control`` pins (the repeat reads the breakpointed prefix from cache, another key never
does, after its TTL the prefix is created again, a restart with the disk dir keeps the pin).

The tiny model writes noise: tool calls are asked for with ``any`` or a named tool over enum
arguments, so the grammar makes each call valid whatever the model says.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from support.servers import SERVED_MODEL_NAME, ServerProcess, start_server, stop_server

KEY_A, KEY_B = "messages-key-a", "messages-key-b"
MAX_SESSION_TTL_S = 1800                     # a 1h cache_control is over it; 5m is within
MAX_REQUEST_BYTES = 200_000
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]},
                                            "units": {"type": "string", "enum": ["C", "F"]}},
           "required": ["city", "units"], "additionalProperties": False}
NOTE = {"type": "object", "properties": {"urgent": {"type": "boolean"}}, "required": ["urgent"],
        "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Weather in a city.", "input_schema": WEATHER},
         {"name": "add_note", "description": "Save a note.", "input_schema": NOTE}]
SCHEMAS = {"get_weather": WEATHER, "add_note": NOTE}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}
LONG_SYSTEM = "You are a careful assistant. " + "Follow the house rules of the lorem ipsum guild. " * 12


@dataclass
class Served:
    """The module's server (replaced by the restart test) and what restarts it."""

    server: ServerProcess
    disk_dir: str


def start(disk_dir: str) -> ServerProcess:
    return start_server("tiny", api_keys=(KEY_A, KEY_B), max_model_len=1024,
                        extra_args=("--disk-cache-dir", disk_dir, "--max-session-ttl", str(MAX_SESSION_TTL_S),
                                    "--max-request-bytes", str(MAX_REQUEST_BYTES)))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    disk_dir = str(tmp_path_factory.mktemp("messages-disk"))
    served = Served(start(disk_dir), disk_dir)
    yield served
    stop_server(served.server)


def client(served: Served, key: str = KEY_A, **options: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=served.server.base_url, api_key=key, max_retries=0, timeout=120, **options)


def create(served: Served, key: str = KEY_A, **fields: Any) -> anthropic.types.Message:
    body = {"model": SERVED_MODEL_NAME, "max_tokens": 8, "messages": ASK, "extra_body": GREEDY, **fields}
    return client(served, key).messages.create(**body)


def post(served: Served, body: Any, headers: dict[str, str] | None = None, path: str = "/v1/messages",
         key: str | None = KEY_A) -> httpx.Response:
    sent = {"x-api-key": key} if key else {}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{served.server.base_url}{path}", content=content, timeout=120,
                      headers={"content-type": "application/json", **sent, **(headers or {})})


def anthropic_error(response: httpx.Response, status: int, error_type: str) -> str:
    """The error's message, once its status and Anthropic shape are checked."""
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == error_type, body
    assert set(body["error"]) == {"type", "message"}, body
    return body["error"]["message"]


def text_of(message: anthropic.types.Message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def pins(served: Served, key: str) -> list[dict[str, Any]]:
    listed = httpx.get(f"{served.server.base_url}/v1/context", headers={"x-api-key": key}).json()
    return [s for s in listed["data"] if s["kind"] == "pin"]


# ---------------------------------------------------------------- text


def test_a_text_answer_with_system_and_usage(served: Served) -> None:
    answer = create(served, system="Answer briefly.")
    assert answer.type == "message" and answer.role == "assistant" and answer.model == SERVED_MODEL_NAME
    assert answer.id.startswith("msg_") and answer.content and answer.content[0].type == "text"
    assert answer.stop_reason in ("end_turn", "max_tokens") and 0 < answer.usage.output_tokens <= 8
    counted = client(served).messages.count_tokens(model=SERVED_MODEL_NAME, messages=ASK, system="Answer briefly.")
    usage = answer.usage
    assert usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens == (
        counted.input_tokens)
    longer = client(served).messages.count_tokens(model=SERVED_MODEL_NAME, messages=ASK, system=LONG_SYSTEM)
    assert longer.input_tokens > counted.input_tokens + 100


def test_multi_turn_and_system_blocks(served: Served) -> None:
    turns = [*ASK, {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "And tomorrow?"}]
    answer = create(served, messages=turns, system=[{"type": "text", "text": "Be terse."},
                                                    {"type": "text", "text": "Be kind."}])
    assert answer.content and answer.usage.output_tokens > 0
    # The system blocks and every turn reach the prompt.
    shorter = client(served).messages.count_tokens(model=SERVED_MODEL_NAME, messages=ASK)
    longer = client(served).messages.count_tokens(model=SERVED_MODEL_NAME, messages=turns, system="Be terse.")
    assert longer.input_tokens > shorter.input_tokens


def test_max_tokens_and_stop_sequences(served: Served) -> None:
    whole = create(served, max_tokens=12)
    assert (whole.stop_reason, whole.usage.output_tokens) == ("max_tokens", 12)
    text = text_of(whole)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = create(served, max_tokens=12, stop_sequences=["never-written-here", stop])
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert text_of(cut) == text[:text.find(stop)]


def test_streamed_events_build_the_whole_answer(served: Served) -> None:
    whole = create(served, max_tokens=10)
    kinds: list[str] = []
    texts: list[str] = []
    with client(served).messages.stream(model=SERVED_MODEL_NAME, max_tokens=10, messages=ASK,
                                        extra_body=GREEDY) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                texts.append(event.delta.text)
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert "".join(texts) == text_of(final) == text_of(whole)
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


# ---------------------------------------------------------------- tools


def check_tool_use(block: Any) -> None:
    assert block.type == "tool_use" and block.id.startswith("toolu_"), block
    jsonschema.validate(block.input, SCHEMAS[block.name])


def test_any_tool_choice_calls_and_the_result_goes_back(served: Served) -> None:
    answer = create(served, tools=TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": True},
                    max_tokens=200)
    assert answer.stop_reason == "tool_use", answer
    (call,) = [b for b in answer.content if b.type == "tool_use"]
    check_tool_use(call)
    turns = [*ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in answer.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 C, sunny"}]}]
    follow = create(served, tools=TOOLS, messages=turns, max_tokens=4)
    assert follow.usage.output_tokens > 0
    with_result = client(served).messages.count_tokens(model=SERVED_MODEL_NAME, messages=turns, tools=TOOLS)
    assert with_result.input_tokens > client(served).messages.count_tokens(
        model=SERVED_MODEL_NAME, messages=ASK, tools=TOOLS).input_tokens


def test_a_named_tool_streams_its_input_json(served: Served) -> None:
    body = {"model": SERVED_MODEL_NAME, "max_tokens": 200, "messages": ASK, "tools": TOOLS,
            "tool_choice": {"type": "tool", "name": "add_note"}, "extra_body": GREEDY}
    whole = client(served).messages.create(**body)
    partial: list[str] = []
    with client(served).messages.stream(**body) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                partial.append(event.delta.partial_json)
        final = stream.get_final_message()
    (call,) = [b for b in final.content if b.type == "tool_use"]
    assert call.name == "add_note" and final.stop_reason == "tool_use"
    check_tool_use(call)
    assert json.loads("".join(partial)) == call.input == [b for b in whole.content if b.type == "tool_use"][0].input


# ---------------------------------------------------------------- errors and headers


@pytest.mark.parametrize(("body", "named"), [
    ({"max_tokens": 4, "messages": ASK, "temprature": 0.5}, "temprature"),
    ({"messages": ASK}, "max_tokens"),
    ({"max_tokens": 4, "messages": ASK, "temperature": 1.5}, "temperature"),
    ({"max_tokens": 4, "messages": ASK, "top_k": -1}, "top_k"),
    ({"max_tokens": 4, "messages": ASK, "stop_sequences": ["s"] * 17}, "stop_sequences"),
    ({"max_tokens": 4, "messages": ASK, "metadata": {"user_id": "u" * 300}}, "metadata.user_id"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0].type"),
    ({"max_tokens": 4, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking"),
    ({"max_tokens": 4, "messages": ASK, "system": [{"type": "text", "text": "s", "cache_control": {"type": "x"}}]},
     "system[0].cache_control.type"),
    ({"max_tokens": 4, "messages": ASK, "system": [
        {"type": "text", "text": f"s{i}", "cache_control": {"type": "ephemeral"}} for i in range(5)]},
     "maximum of 4"),
    ({"max_tokens": 4, "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice.name"),
    ({"max_tokens": 4, "messages": ASK, "kv_cache_retention_config": {
        "token_range_retention_configs": [{"token_start": 0, "token_end": 8, "priority": 101}]}}, "priority"),
])
def test_bad_bodies_are_invalid_request_errors(served: Served, body: dict[str, Any], named: str) -> None:
    message = anthropic_error(post(served, {"model": SERVED_MODEL_NAME, **body}), 400, "invalid_request_error")
    assert named in message


def test_a_last_assistant_message_is_a_prefill_the_answer_goes_on_from(served: Served) -> None:
    prefill = [*ASK, {"role": "assistant", "content": "The weather in Paris is"}]
    answer = create(served, messages=prefill, max_tokens=8)
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.usage.output_tokens > 0
    # The prompt is the chat left open after the prefill: vLLM's continue_final_message.
    ids = post(served, {"model": SERVED_MODEL_NAME, "messages": prefill, "add_generation_prompt": False,
                        "continue_final_message": True}, path="/tokenize").json()["tokens"]
    usage = answer.usage
    assert usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens == len(ids)
    assert client(served).messages.count_tokens(model=SERVED_MODEL_NAME, messages=prefill).input_tokens == len(ids)
    # The answer holds only what follows the prefill: the model's greedy continuation of those ids.
    completion = post(served, {"model": SERVED_MODEL_NAME, "prompt": ids, "max_tokens": 8, **GREEDY},
                      path="/v1/completions").json()
    assert text_of(answer) == completion["choices"][0]["text"]
    chat = post(served, {"model": SERVED_MODEL_NAME, "messages": prefill, "max_tokens": 8, **GREEDY,
                         "add_generation_prompt": False, "continue_final_message": True},
                path="/v1/chat/completions").json()
    assert chat["choices"][0]["message"]["content"] == text_of(answer)
    # Anthropic's rules for a prefill: no trailing whitespace, no tool_use blocks.
    for last in ({"role": "assistant", "content": "The weather is "},
                 {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                    "input": {"city": "Paris", "units": "C"}}]}):
        message = anthropic_error(post(served, {"model": SERVED_MODEL_NAME, "max_tokens": 4, "tools": TOOLS,
                                                "messages": [*ASK, last]}), 400, "invalid_request_error")
        assert "messages[1].content" in message


def test_the_sdks_beta_client_is_served_and_other_query_parameters_are_refused(served: Served) -> None:
    # Anthropic's SDKs send their beta client's calls to /v1/messages?beta=true.
    answer = client(served).beta.messages.create(model=SERVED_MODEL_NAME, max_tokens=4, messages=ASK,
                                                 betas=["prompt-caching-2024-07-31"], extra_body=GREEDY)
    assert answer.content and answer.usage.output_tokens > 0
    assert client(served).beta.messages.count_tokens(model=SERVED_MODEL_NAME, messages=ASK).input_tokens > 0
    body = {"model": SERVED_MODEL_NAME, "max_tokens": 4, "messages": ASK}
    for path, named in (("/v1/messages?beta=false", "'beta'"), ("/v1/messages?stream=true", "'stream'"),
                        ("/v1/messages/count_tokens?x=1", "'x'")):
        assert named in anthropic_error(post(served, body, path=path), 400, "invalid_request_error")


def test_every_failure_has_anthropics_shape(served: Served) -> None:
    body = {"model": SERVED_MODEL_NAME, "max_tokens": 4, "messages": ASK}
    anthropic_error(post(served, b"{not json"), 400, "invalid_request_error")
    anthropic_error(post(served, {**body, "model": "claude-opus"}), 404, "not_found_error")
    anthropic_error(post(served, body, key=None), 401, "authentication_error")
    anthropic_error(post(served, body, key="wrong"), 401, "authentication_error")
    anthropic_error(post(served, {**body, "system": "x" * MAX_REQUEST_BYTES}), 413, "request_too_large")
    anthropic_error(post(served, body, path="/v1/messages/batches"), 404, "not_found_error")
    anthropic_error(post(served, {"model": "nope", "messages": ASK}, path="/v1/messages/count_tokens"), 404,
                    "not_found_error")
    assert "max_tokens" in anthropic_error(post(served, body, path="/v1/messages/count_tokens"), 400,
                                           "invalid_request_error")
    with pytest.raises(anthropic.NotFoundError):
        create(served, model="claude-opus")
    with pytest.raises(anthropic.AuthenticationError):
        create(served, key="wrong")


def test_no_op_fields_and_the_retention_config_are_taken(served: Served) -> None:
    retention = {"token_range_retention_configs": [{"token_start": 0, "token_end": 8, "priority": 90}],
                 "decode_retention_priority": 10}
    answer = create(served, metadata={"user_id": "user-7"}, service_tier="standard_only", max_tokens=2,
                    extra_body={**GREEDY, "kv_cache_retention_config": retention,
                                "thinking": {"type": "disabled"}})
    assert answer.usage.output_tokens == 2
    out_of_prompt = {"token_range_retention_configs": [{"token_start": 0, "token_end": 100_000, "priority": 90}]}
    body = {"model": SERVED_MODEL_NAME, "max_tokens": 2, "messages": ASK, "kv_cache_retention_config": out_of_prompt}
    assert "outside the prompt" in anthropic_error(post(served, body), 400, "invalid_request_error")


def test_api_key_headers_and_anthropic_headers(served: Served) -> None:
    bearer = anthropic.Anthropic(base_url=served.server.base_url, auth_token=KEY_B, max_retries=0, timeout=120)
    assert bearer.messages.count_tokens(model=SERVED_MODEL_NAME, messages=ASK).input_tokens > 0
    body = {"model": SERVED_MODEL_NAME, "max_tokens": 2, "messages": ASK}
    assert post(served, body, {"anthropic-version": "2023-06-01",
                               "anthropic-beta": "prompt-caching-2024-07-31,token-counting-2024-11-01"}).status_code == 200
    # The SDK's beta resource (?beta=true, anthropic-beta) with a no-op beta.
    beta = client(served).beta.messages.create(model=SERVED_MODEL_NAME, max_tokens=2, messages=ASK,
                                               betas=["prompt-caching-2024-07-31"], extra_body=GREEDY)
    assert beta.usage.output_tokens == 2
    assert "anthropic-version" in anthropic_error(post(served, body, {"anthropic-version": "June 2023"}), 400,
                                                  "invalid_request_error")
    assert "mcp-client-2025-04-04" in anthropic_error(post(served, body, {"anthropic-beta": "mcp-client-2025-04-04"}),
                                                      400, "invalid_request_error")


# ---------------------------------------------------------------- cache_control


def cached_system(ttl: str = "5m") -> list[dict[str, Any]]:
    return [{"type": "text", "text": LONG_SYSTEM, "cache_control": {"type": "ephemeral", "ttl": ttl}}]


def test_the_repeat_reads_the_breakpointed_prefix_and_another_key_never_does(served: Served) -> None:
    first = create(served, system=cached_system(), max_tokens=2)
    created = first.usage.cache_creation_input_tokens
    assert created > 0 and first.usage.cache_read_input_tokens == 0
    [pin] = pins(served, KEY_A)
    assert pin["tokens"] == created and pin["ttl"] == 300 and pins(served, KEY_B) == []
    again = create(served, system=cached_system(), max_tokens=2,
                   messages=[{"role": "user", "content": "And in Lima?"}])
    assert (again.usage.cache_read_input_tokens, again.usage.cache_creation_input_tokens) == (created, 0)
    assert again.usage.input_tokens > 0
    other = create(served, KEY_B, system=cached_system(), max_tokens=2)
    assert (other.usage.cache_read_input_tokens, other.usage.cache_creation_input_tokens) == (0, created)
    # A stream's message_delta carries the same counters.
    with client(served).messages.stream(model=SERVED_MODEL_NAME, max_tokens=2, messages=ASK, system=cached_system(),
                                        extra_body=GREEDY) as stream:
        streamed = stream.get_final_message().usage
    assert (streamed.cache_read_input_tokens, streamed.cache_creation_input_tokens) == (created, 0)


def test_a_conversation_reads_what_its_previous_turn_pinned(served: Served) -> None:
    def turn(text: str) -> dict[str, Any]:
        return {"role": "user", "content": [{"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}]}

    history = [turn("Remember the list: " + "alpha beta gamma delta " * 8)]
    first = create(served, KEY_B, messages=history, max_tokens=4)
    assert first.usage.cache_read_input_tokens == 0 and first.usage.cache_creation_input_tokens > 0
    # The next turn carries its breakpoint on its own last block only, as coding agents do.
    history[0]["content"][0].pop("cache_control")
    history += [{"role": "assistant", "content": text_of(first)}, turn("And the second item?")]
    second = create(served, KEY_B, messages=history, max_tokens=4)
    usage = second.usage
    assert 0 < usage.cache_read_input_tokens <= first.usage.cache_creation_input_tokens
    assert usage.cache_creation_input_tokens > 0
    total = client(served, KEY_B).messages.count_tokens(model=SERVED_MODEL_NAME, messages=history).input_tokens
    assert usage.cache_read_input_tokens + usage.cache_creation_input_tokens + usage.input_tokens == total


def test_a_ttl_over_the_servers_cap_pins_nothing(served: Served) -> None:
    before = pins(served, KEY_B)
    body = {"model": SERVED_MODEL_NAME, "max_tokens": 2, "messages": ASK, "system": cached_system("1h")}
    assert "max-session-ttl" in anthropic_error(post(served, body, key=KEY_B), 400, "invalid_request_error")
    assert pins(served, KEY_B) == before


def test_after_its_ttl_the_prefix_is_created_again(served: Served) -> None:
    system = [{"type": "text", "text": "Expiry edition. " + LONG_SYSTEM, "cache_control": {"type": "ephemeral"}}]
    before = {p["id"] for p in pins(served, KEY_A)}
    first = create(served, system=system, max_tokens=2)
    (pin_id,) = {p["id"] for p in pins(served, KEY_A)} - before
    # The pin's TTL shortened to a second through the session API; then it expires.
    patched = httpx.patch(f"{served.server.base_url}/v1/context/{pin_id}", json={"ttl": 1},
                          headers={"x-api-key": KEY_A})
    assert patched.status_code == 200, patched.text
    time.sleep(1.5)
    again = create(served, system=system, max_tokens=2)
    assert (again.usage.cache_read_input_tokens, again.usage.cache_creation_input_tokens) == (
        0, first.usage.cache_creation_input_tokens)


def test_a_restart_with_the_disk_dir_keeps_the_pin(served: Served) -> None:
    system = [{"type": "text", "text": "Restart edition. " + LONG_SYSTEM, "cache_control": {"type": "ephemeral"}}]
    first = create(served, system=system, max_tokens=2)
    assert first.usage.cache_creation_input_tokens > 0
    stop_server(served.server)
    served.server = start(served.disk_dir)
    again = create(served, system=system, max_tokens=2)
    assert again.usage.cache_read_input_tokens == first.usage.cache_creation_input_tokens
    assert again.usage.cache_creation_input_tokens == 0
    assert Path(served.disk_dir).exists()
