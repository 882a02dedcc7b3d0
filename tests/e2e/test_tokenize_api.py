"""``POST /tokenize`` and ``POST /detokenize`` on a real ``kvhive serve`` replica (default model, an
API key) and on a real gateway in front of it, over HTTP: the ids are the ones generation uses,
the gateway answers as the replica does, and malformed bodies are OpenAI-shaped 400s on both."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from support.cluster import ReplicaProcess, running_replicas, start_gateway, stop_gateway

from kvhive.core.model_files import default_model_path
from kvhive.core.tokenizer import Tokenizer

MODEL = "smollm2-135m"
KEY = "tokenize-key"
AUTH = {"authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 1024                    # ReplicaProcess's --max-model-len
PROMPT = "The capital of France is Paris. naïve café, 12345 and emoji 🚀 too"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
TOOL_CHAT = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "grey"}]


@pytest.fixture(scope="module")
def urls() -> Iterator[dict[str, str]]:
    """The replica's and the gateway's base URLs."""
    replica = ReplicaProcess(extra_args=("--api-key", KEY))
    with running_replicas([replica], print_logs=False):
        cluster = start_gateway([replica], "--replica-api-key", KEY)
        try:
            yield {"server": replica.url, "gateway": cluster.gateway_url}
        finally:
            stop_gateway(cluster)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_model_path(default_model_path())


def post(url: str, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=AUTH if headers is None else headers, timeout=120)


def tokenize(url: str, **body: Any) -> dict[str, Any]:
    response = post(url, "/tokenize", {"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_prompt_ids_are_the_ones_the_engine_computes(urls: dict[str, str], tokenizer: Tokenizer) -> None:
    answer = tokenize(urls["server"], prompt=PROMPT)
    assert answer["tokens"] == tokenizer.encode(PROMPT)
    assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] == MAX_MODEL_LEN
    assert answer["token_strs"] is None
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 0}
    by_text = post(urls["server"], "/v1/completions", {**body, "prompt": PROMPT}).json()
    by_ids = post(urls["server"], "/v1/completions", {**body, "prompt": answer["tokens"]}).json()
    assert by_text["usage"]["prompt_tokens"] == answer["count"]
    # The echoed prompt's logprobs list one entry per token the engine read, then the 4 generated.
    assert len(by_text["choices"][0]["logprobs"]["tokens"]) == answer["count"] + 4
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]


def test_chat_ids_are_the_ones_a_chat_completion_reads(urls: dict[str, str], tokenizer: Tokenizer) -> None:
    answer = tokenize(urls["server"], messages=CHAT)
    assert answer["tokens"] == tokenizer.encode_chat(CHAT)
    chat = post(urls["server"], "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 1})
    assert chat.json()["usage"]["prompt_tokens"] == answer["count"]
    without = tokenize(urls["server"], messages=CHAT, add_generation_prompt=False)["tokens"]
    assert without == tokenizer.encode_chat(CHAT, add_generation_prompt=False)
    assert answer["tokens"][:len(without)] == without and len(without) < answer["count"]
    opening = post(urls["server"], "/detokenize", {"tokens": answer["tokens"][len(without):]}).json()
    assert opening["prompt"] == "<|im_start|>assistant\n"


def test_tools_are_rendered_as_a_chat_completion_renders_them(urls: dict[str, str]) -> None:
    for messages in (CHAT, TOOL_CHAT):
        answer = tokenize(urls["server"], messages=messages, tools=TOOLS)
        chat = post(urls["server"], "/v1/chat/completions", {"model": MODEL, "messages": messages, "tools": TOOLS,
                                                             "max_tokens": 1})
        assert chat.json()["usage"]["prompt_tokens"] == answer["count"]
        assert answer["count"] > tokenize(urls["server"], messages=messages)["count"]    # the definitions
        assert tokenize(urls["gateway"], messages=messages, tools=TOOLS) == answer


def test_continue_final_message_leaves_the_last_message_open(urls: dict[str, str]) -> None:
    messages = [*CHAT, {"role": "assistant", "content": "Deep blue"}]
    answer = tokenize(urls["server"], messages=messages, add_generation_prompt=False, continue_final_message=True)
    text = post(urls["server"], "/detokenize", {"tokens": answer["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\nDeep blue")


def test_add_special_tokens_both_ways(urls: dict[str, str], tokenizer: Tokenizer) -> None:
    # This model's tokenizer adds no BOS (its GGUF says add_bos_token false): both ways agree with
    # it; a tokenizer that adds one is covered in tests/unit/test_tokenize_bodies.py.
    for flag in (True, False):
        assert tokenize(urls["server"], prompt=PROMPT, add_special_tokens=flag)["tokens"] == \
            tokenizer.encode(PROMPT, add_special_tokens=flag)
        assert tokenize(urls["server"], messages=CHAT, add_special_tokens=flag)["tokens"] == \
            tokenizer.encode(tokenizer.apply_chat_template(CHAT), add_special_tokens=flag)


def test_detokenize_round_trip_and_token_strings(urls: dict[str, str], tokenizer: Tokenizer) -> None:
    answer = tokenize(urls["server"], prompt=PROMPT, return_token_strs=True)
    assert len(answer["token_strs"]) == answer["count"]
    # vLLM's token strings are the vocabulary's pieces (byte-level BPE: a leading space is "Ġ").
    assert answer["token_strs"][:3] == ["The", "Ġcapital", "Ġof"]
    assert b"".join(tokenizer.token_bytes(i) for i in answer["tokens"]) == PROMPT.encode()
    back = post(urls["server"], "/detokenize", {"model": MODEL, "tokens": answer["tokens"]}).json()
    assert back == {"prompt": PROMPT}
    chat = tokenize(urls["server"], messages=CHAT)["tokens"]
    text = post(urls["server"], "/detokenize", {"tokens": chat}).json()["prompt"]
    assert text == tokenizer.apply_chat_template(CHAT)            # special tokens written out


GOOD_BODIES = [
    ("/tokenize", {"model": MODEL, "prompt": PROMPT}),
    ("/tokenize", {"prompt": PROMPT, "add_special_tokens": False, "return_token_strs": True}),
    ("/tokenize", {"model": MODEL, "messages": CHAT}),
    ("/tokenize", {"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                  {"type": "text", "text": "b"}]},
                                {"role": "user", "content": "hi", "name": "ann"}],
                   "add_generation_prompt": False, "return_token_strs": True}),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"unused_variable": 1}}),
    ("/tokenize", {"messages": TOOL_CHAT, "tools": TOOLS, "return_token_strs": True}),
    ("/detokenize", {"model": MODEL, "tokens": [1, 19556, 905, 2]}),
    ("/detokenize", {"tokens": []}),
]


@pytest.mark.parametrize(("path", "body"), GOOD_BODIES)
def test_the_gateway_answers_as_the_replica(urls: dict[str, str], path: str, body: dict[str, Any]) -> None:
    server = post(urls["server"], path, body)
    gateway = post(urls["gateway"], path, body)
    assert server.status_code == gateway.status_code == 200, (server.text, gateway.text)
    assert gateway.json() == server.json()


BAD_BODIES = [
    ("/tokenize", {"model": MODEL, "prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "hi", "messages": CHAT}, "prompt"),
    ("/tokenize", {"model": MODEL}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),
    ("/tokenize", {"messages": CHAT, "chat_template": "{{ messages }}"}, "chat_template"),
    ("/tokenize", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools[0].function"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ("/tokenize", [PROMPT], None),
    ("/detokenize", {"tokens": [1, -3]}, "tokens[1]"),
    ("/detokenize", {"tokens": [49152]}, "tokens[0]"),
    ("/detokenize", {"tokens": [1, "2"]}, "tokens[1]"),
    ("/detokenize", {"tokens": 7}, "tokens"),
    ("/detokenize", {"tokens": list(range(MAX_MODEL_LEN + 1))}, "tokens"),
    ("/detokenize", {}, "tokens"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_BODIES)
def test_malformed_bodies_are_openai_400s(urls: dict[str, str], path: str, body: Any, param: str | None) -> None:
    for url in (urls["server"], urls["gateway"]):
        response = post(url, path, body)
        assert response.status_code == 400, (url, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"]
        assert error["param"] == param, (url, error)


def test_not_json_unknown_model_and_missing_key(urls: dict[str, str]) -> None:
    for url in (urls["server"], urls["gateway"]):
        broken = httpx.post(url + "/tokenize", content=b"{not json", headers=AUTH, timeout=30)
        assert broken.status_code == 400 and broken.json()["error"]["type"] == "invalid_request_error"
        unknown = post(url, "/tokenize", {"model": "nope", "prompt": "hi"})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
        for path, body in GOOD_BODIES[:1] + GOOD_BODIES[-2:-1]:
            refused = post(url, path, body, headers={})
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
