"""Bad requests get OpenAI-shaped errors with the right status, and the server keeps serving."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from support.api import assert_error
from support.servers import FAULT_TOKEN_IDS, TINY_API_KEY, TINY_MAX_MODEL_LEN, ServerProcess, read_sse

MODEL = "smollm2-135m"
CHAT = [{"role": "user", "content": "hi"}]


def assert_still_serving(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1


COMPLETION_CASES: list[tuple[str, Any, int, str | None, str | None]] = [
    # (case, body, status, param, code)
    ("missing prompt", {"model": MODEL}, 400, "prompt", None),
    ("missing model", {"prompt": "x"}, 400, "model", None),
    ("prompt of wrong type", {"model": MODEL, "prompt": 5}, 400, "prompt", None),
    ("max_tokens as string", {"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400, "max_tokens", None),
    ("max_tokens zero", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    ("max_tokens negative", {"model": MODEL, "prompt": "x", "max_tokens": -3}, 400, "max_tokens", None),
    ("max_tokens beyond context", {"model": MODEL, "prompt": "x", "max_tokens": TINY_MAX_MODEL_LEN},
     400, "max_tokens", "context_length_exceeded"),
    ("temperature out of range", {"model": MODEL, "prompt": "x", "temperature": 3.5}, 400, "temperature", None),
    ("top_p zero", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p", None),
    ("stop of wrong type", {"model": MODEL, "prompt": "x", "stop": 3}, 400, "stop", None),
    ("more prompts than the cap", {"model": MODEL, "prompt": ["a"] * 65}, 400, "prompt", None),
    ("more choices than the cap", {"model": MODEL, "prompt": [[1, 2], [3]] * 20, "n": 2}, 400, "prompt", None),
    ("an empty prompt among several", {"model": MODEL, "prompt": ["a", ""]}, 400, "prompt", None),
    ("stream_options without stream", {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}},
     400, "stream_options", None),
    ("prompt_logprobs above 20", {"model": MODEL, "prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs", None),
    ("prompt_logprobs streamed", {"model": MODEL, "prompt": "x", "prompt_logprobs": 1, "stream": True},
     400, "prompt_logprobs", None),
    ("empty prompt", {"model": MODEL, "prompt": ""}, 400, "prompt", None),
    ("token id outside vocab", {"model": MODEL, "prompt": [1, 10**9]}, 400, "prompt", None),
    ("n zero", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n", None),
    ("n above the cap", {"model": MODEL, "prompt": "x", "n": 17}, 400, "n", None),
    ("n as string", {"model": MODEL, "prompt": "x", "n": "2"}, 400, "n", None),
    ("logprobs negative", {"model": MODEL, "prompt": "x", "logprobs": -1}, 400, "logprobs", None),
    ("logprobs above 20", {"model": MODEL, "prompt": "x", "logprobs": 21}, 400, "logprobs", None),
    ("logprobs as bool", {"model": MODEL, "prompt": "x", "logprobs": True}, 400, "logprobs", None),
    ("max_tokens zero without echo", {"model": MODEL, "prompt": "x", "max_tokens": 0, "logprobs": 1},
     400, "max_tokens", None),
    ("echo as string", {"model": MODEL, "prompt": "x", "echo": "yes"}, 400, "echo", None),
    ("best_of 2", {"model": MODEL, "prompt": "x", "best_of": 2}, 400, "best_of", None),
    ("best_of below n", {"model": MODEL, "prompt": "x", "best_of": 1, "n": 2}, 400, "best_of", None),
    ("stream as string", {"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream", None),
    ("stream_options of wrong type", {"model": MODEL, "prompt": "x", "stream": True,
                                      "stream_options": {"include_usage": "yes"}},
     400, "stream_options.include_usage", None),
    ("unknown model", {"model": "gpt-4", "prompt": "x"}, 404, "model", "model_not_found"),
]

CHAT_CASES: list[tuple[str, Any, int, str | None, str | None]] = [
    ("missing messages", {"model": MODEL}, 400, "messages", None),
    ("empty messages", {"model": MODEL, "messages": []}, 400, "messages", None),
    ("unknown role", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
     400, "messages[0].role", None),
    ("content of wrong type", {"model": MODEL, "messages": [{"role": "user", "content": 7}]},
     400, "messages[0].content", None),
    ("image content part", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages[0].content[1].type", None),
    ("message not an object", {"model": MODEL, "messages": ["hello"]}, 400, "messages[0]", None),
    ("max_completion_tokens zero", {"model": MODEL, "messages": CHAT, "max_completion_tokens": 0},
     400, "max_completion_tokens", None),
    ("max_tokens beyond context", {"model": MODEL, "messages": CHAT, "max_tokens": 10**6},
     400, "max_tokens", "context_length_exceeded"),
    ("n negative", {"model": MODEL, "messages": CHAT, "n": -1}, 400, "n", None),
    ("n above the cap", {"model": MODEL, "messages": CHAT, "n": 100}, 400, "n", None),
    ("logprobs as int", {"model": MODEL, "messages": CHAT, "logprobs": 1}, 400, "logprobs", None),
    ("top_logprobs without logprobs", {"model": MODEL, "messages": CHAT, "top_logprobs": 2},
     400, "top_logprobs", None),
    ("top_logprobs with logprobs false", {"model": MODEL, "messages": CHAT, "logprobs": False,
                                          "top_logprobs": 0}, 400, "top_logprobs", None),
    ("top_logprobs above 20", {"model": MODEL, "messages": CHAT, "logprobs": True, "top_logprobs": 21},
     400, "top_logprobs", None),
    ("top_logprobs negative", {"model": MODEL, "messages": CHAT, "logprobs": True, "top_logprobs": -1},
     400, "top_logprobs", None),
    ("top_logprobs as float", {"model": MODEL, "messages": CHAT, "logprobs": True, "top_logprobs": 2.5},
     400, "top_logprobs", None),
    ("unknown model", {"model": "nope", "messages": CHAT}, 404, "model", "model_not_found"),
]


@pytest.mark.parametrize(("case", "body", "status", "param", "code"), COMPLETION_CASES,
                         ids=[c[0] for c in COMPLETION_CASES])
def test_bad_completion_requests(tiny_client: httpx.Client, case: str, body: Any, status: int,
                                 param: str | None, code: str | None) -> None:
    assert_error(tiny_client.post("/v1/completions", json=body), status, param=param, code=code)
    assert_still_serving(tiny_client)


@pytest.mark.parametrize(("case", "body", "status", "param", "code"), CHAT_CASES,
                         ids=[c[0] for c in CHAT_CASES])
def test_bad_chat_requests(tiny_client: httpx.Client, case: str, body: Any, status: int,
                           param: str | None, code: str | None) -> None:
    assert_error(tiny_client.post("/v1/chat/completions", json=body), status, param=param, code=code)
    assert_still_serving(tiny_client)


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b"\xff\xfe", b'"just a string"'])
def test_malformed_bodies(tiny_client: httpx.Client, raw: bytes) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = tiny_client.post(path, content=raw, headers={"Content-Type": "application/json"})
        assert_error(r, 400)
    assert_still_serving(tiny_client)


def test_json_without_json_content_type_is_accepted(tiny_client: httpx.Client) -> None:
    # curl -d sends application/x-www-form-urlencoded; OpenAI servers read the JSON anyway.
    r = tiny_client.post("/v1/completions", content=b'{"model": "%s", "prompt": "x", "max_tokens": 1}'
                         % MODEL.encode(), headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200, r.text


def test_context_overflow_messages_give_the_numbers(tiny_client: httpx.Client) -> None:
    long_prompt = list(range(100, 100 + TINY_MAX_MODEL_LEN))
    r = tiny_client.post("/v1/completions", json={"model": MODEL, "prompt": long_prompt})
    assert_error(r, 400, param="prompt", code="context_length_exceeded",
                 contains=(str(TINY_MAX_MODEL_LEN), str(len(long_prompt))))
    prompt_len, max_tokens = TINY_MAX_MODEL_LEN - 50, 100
    body = {"model": MODEL, "prompt": long_prompt[:prompt_len], "max_tokens": max_tokens}
    assert_error(tiny_client.post("/v1/completions", json=body), 400, param="max_tokens",
                 code="context_length_exceeded",
                 contains=(str(TINY_MAX_MODEL_LEN), str(prompt_len + max_tokens), str(prompt_len)))
    assert_still_serving(tiny_client)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TINY_API_KEY},
                                     {"Authorization": f"Basic {TINY_API_KEY}"}],
                         ids=["missing", "wrong", "no scheme", "basic"])
def test_api_key_required(tiny_server: ServerProcess, tiny_client: httpx.Client,
                          headers: dict[str, str]) -> None:
    url = tiny_server.base_url
    assert_error(httpx.get(f"{url}/v1/models", headers=headers), 401, code="invalid_api_key")
    r = httpx.post(f"{url}/v1/chat/completions", headers=headers, json={"model": MODEL, "messages": CHAT})
    assert_error(r, 401, code="invalid_api_key")
    assert_error(httpx.post(f"{url}/v1/completions", headers=headers, content=b"{bad"), 401,
                 code="invalid_api_key")
    assert httpx.get(f"{url}/health").status_code == 200
    assert_still_serving(tiny_client)


def test_unknown_route_and_method(tiny_server: ServerProcess, tiny_client: httpx.Client) -> None:
    assert_error(tiny_client.get("/v1/engines"), 404, code="not_found")
    assert_error(httpx.get(f"{tiny_server.base_url}/nothing/here"), 404, code="not_found")
    assert_error(tiny_client.delete("/v1/models"), 405, code="method_not_allowed")
    assert_error(tiny_client.get("/v1/completions"), 405, code="method_not_allowed")
    assert_still_serving(tiny_client)


def test_engine_error_is_a_500(tiny_client: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": FAULT_TOKEN_IDS, "max_tokens": 2}
    assert_error(tiny_client.post("/v1/completions", json=body), 500, error_type="server_error",
                 code="internal_server_error", contains=("injected engine failure",))
    assert_still_serving(tiny_client)
    # Streaming: the headers are out before the engine fails, so the error comes as an event.
    with tiny_client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = read_sse(r)
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["type"] == "server_error" and "injected engine failure" in error["message"]
    assert_still_serving(tiny_client)
