"""OpenAI's prompt-cache fields and the retention config over real HTTP with the ``openai`` SDK:
``prompt_cache_retention`` pins the prompt for its key within its budgets, ``prompt_cache_key`` is
bounded, ``kv_cache_retention_config`` is checked; every bad value is a 400 naming its field and
pins nothing (one tiny-model server, two API keys)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from support.servers import SERVED_MODEL_NAME, ServerProcess, start_server, stop_server

KEY_A, KEY_B = "pins-key-a", "pins-key-b"
MAX_TTL_S, MAX_SESSIONS = 3600, 3
MESSAGES = [{"role": "user", "content": "Pin this prefix: " + "lorem ipsum " * 20}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    server = start_server("tiny", api_keys=(KEY_A, KEY_B), max_model_len=512,
                          extra_args=("--max-session-ttl", str(MAX_TTL_S),
                                      "--max-sessions-per-key", str(MAX_SESSIONS)))
    yield server
    stop_server(server)


def client(server: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=120)


def pins(server: ServerProcess, key: str) -> list[dict[str, Any]]:
    listed = httpx.get(f"{server.base_url}/v1/context", headers={"Authorization": f"Bearer {key}"}).json()
    return [s for s in listed["data"] if s["kind"] == "pin"]


def chat(server: ServerProcess, key: str = KEY_A, **fields: Any):
    return client(server, key).chat.completions.create(model=SERVED_MODEL_NAME, messages=MESSAGES, max_tokens=2,
                                                      temperature=0, **fields)


def refused(call, param: str, status: int = 400) -> None:
    with pytest.raises(openai.APIStatusError) as caught:
        call()
    assert caught.value.status_code == status, caught.value.body
    assert caught.value.body["param"] == param, caught.value.body


def test_prompt_cache_retention_pins_the_prompt_for_its_key(server: ServerProcess) -> None:
    first = chat(server, prompt_cache_retention="in_memory", prompt_cache_key="agent-7")
    [pin] = pins(server, KEY_A)
    assert pin["tokens"] == first.usage.prompt_tokens and pin["ttl"] == 300 and not pin["busy"]
    assert pin["num_blocks"] > 0 and pins(server, KEY_B) == []
    # The repeat is the same pin, read from cache (OpenAI's counter: the engine's cached tokens).
    again = chat(server, prompt_cache_retention="in_memory")
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert [p["id"] for p in pins(server, KEY_A)] == [pin["id"]]
    # A pin is deleted like a session.
    assert httpx.delete(f"{server.base_url}/v1/context/{pin['id']}",
                        headers={"Authorization": f"Bearer {KEY_A}"}).status_code == 200
    assert pins(server, KEY_A) == []


def test_responses_take_prompt_cache_retention(server: ServerProcess) -> None:
    answer = client(server, KEY_B).responses.create(model=SERVED_MODEL_NAME, input="Pin me: " + "dolor " * 30,
                                                   max_output_tokens=2, store=False,
                                                   prompt_cache_retention="in_memory", prompt_cache_key="agent-7")
    assert [p["tokens"] for p in pins(server, KEY_B)] == [answer.usage.input_tokens]
    assert (answer.prompt_cache_retention, answer.prompt_cache_key) == ("in_memory", "agent-7")


def test_bad_prompt_cache_fields_are_refused_and_pin_nothing(server: ServerProcess) -> None:
    before = pins(server, KEY_A)
    refused(lambda: chat(server, prompt_cache_retention="24h"), "prompt_cache_retention")    # over 3600 s
    refused(lambda: chat(server, extra_body={"prompt_cache_retention": "in-memory"}), "prompt_cache_retention")
    refused(lambda: chat(server, prompt_cache_key="k" * 10_000), "prompt_cache_key")
    refused(lambda: client(server, KEY_A).responses.create(model=SERVED_MODEL_NAME, input="x", max_output_tokens=2,
                                                          prompt_cache_retention="24h"), "prompt_cache_retention")
    assert chat(server, prompt_cache_key="k" * 1024).usage.completion_tokens > 0
    assert pins(server, KEY_A) == before


def test_the_key_session_budget_bounds_its_pins(server: ServerProcess) -> None:
    owned = len(pins(server, KEY_A))
    for i in range(MAX_SESSIONS - owned):
        client(server, KEY_A).chat.completions.create(
            model=SERVED_MODEL_NAME, messages=[{"role": "user", "content": f"prompt {i} " * 10}], max_tokens=1,
            prompt_cache_retention="in_memory")
    refused(lambda: chat(server, prompt_cache_retention="in_memory"), None, status=429)
    assert len(pins(server, KEY_A)) == MAX_SESSIONS
    for pin in pins(server, KEY_A):
        httpx.delete(f"{server.base_url}/v1/context/{pin['id']}", headers={"Authorization": f"Bearer {KEY_A}"})


RETENTION = {"token_range_retention_configs": [{"token_start": 0, "token_end": 8, "priority": 90,
                                                "duration_ms": 60_000}], "decode_retention_priority": 10}
BAD_RETENTIONS = [
    ({"token_range_retention_configs": [{"token_start": 0, "token_end": 8, "priority": 101}]},
     "kv_cache_retention_config.token_range_retention_configs[0].priority"),
    ({"token_range_retention_configs": [{"token_start": 0, "token_end": 100_000, "priority": 50}]},
     "kv_cache_retention_config.token_range_retention_configs"),
    ({"token_range_retention_configs": [{"token_start": 0, "token_end": 8, "priority": 50},
                                        {"token_start": 4, "token_end": 12, "priority": 50}]},
     "kv_cache_retention_config.token_range_retention_configs"),
    ({"decode_priority": 50}, "kv_cache_retention_config.decode_priority"),
]


def test_kv_cache_retention_config_is_taken_on_every_endpoint_and_checked(server: ServerProcess) -> None:
    a = client(server, KEY_A)
    extra = {"kv_cache_retention_config": RETENTION}
    assert a.completions.create(model=SERVED_MODEL_NAME, prompt="Retain " * 12, max_tokens=2, extra_body=extra)
    assert chat(server, extra_body=extra).choices
    assert a.responses.create(model=SERVED_MODEL_NAME, input="Retain " * 12, max_output_tokens=2, store=False,
                              extra_body=extra).output
    for bad, param in BAD_RETENTIONS:
        body = {"kv_cache_retention_config": bad}
        refused(lambda body=body: a.completions.create(model=SERVED_MODEL_NAME, prompt="Retain " * 12,
                                                      max_tokens=2, extra_body=body), param)
        refused(lambda body=body: chat(server, extra_body=body), param)


def test_a_streamed_chat_and_several_choices_pin_once(server: ServerProcess) -> None:
    messages = [{"role": "user", "content": "Stream and pin: " + "sit amet " * 20}]
    stream = client(server, KEY_B).chat.completions.create(
        model=SERVED_MODEL_NAME, messages=messages, max_tokens=2, stream=True, prompt_cache_retention="in_memory")
    assert [chunk.id for chunk in stream]
    choices = client(server, KEY_B).chat.completions.create(
        model=SERVED_MODEL_NAME, messages=messages, max_tokens=2, n=2, prompt_cache_retention="in_memory")
    assert len(choices.choices) == 2
    streamed = [p for p in pins(server, KEY_B) if p["tokens"] == choices.usage.prompt_tokens]
    assert len(streamed) == 1 and not streamed[0]["busy"] and streamed[0]["num_blocks"] > 0
