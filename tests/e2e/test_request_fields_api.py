"""Nothing a client sends is silently ignored, over real HTTP on the tiny server: an unknown field,
at the top or nested, is a 400 naming its path on chat, completions, responses, /v1/context,
/tokenize and /detokenize; the documented no-op fields answer 200; each sampling extra out of its
bounds is a 400 naming it (a field of another kind of content part on a text part too); a query
parameter a route does not take is a 400 naming it; and the extras that change the text do what
vLLM's do (logit_bias, min_tokens, include_stop_str_in_output, skip_special_tokens,
truncate_prompt_tokens)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from support.api import assert_error

from kvhive.core.request_fields import NO_OP_FIELDS, UNRECOGNIZED_FIELD

MODEL = "smollm2-135m"
CHAT = [{"role": "user", "content": "hi"}]
COMPLETION = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2}
CHAT_BODY = {"model": MODEL, "messages": CHAT, "max_tokens": 2}
RESPONSES_BODY = {"model": MODEL, "input": "hi", "max_output_tokens": 2, "store": False}

UNKNOWN: list[tuple[str, dict[str, Any], str]] = [
    # (path, body, the unknown field's path)
    ("/v1/chat/completions", {**CHAT_BODY, "frobnicate": 1}, "frobnicate"),
    ("/v1/chat/completions", {**CHAT_BODY, "guided_whatever": "x"}, "guided_whatever"),
    ("/v1/chat/completions", {**CHAT_BODY, "messages": [{"role": "user", "content": "x", "colour": "red"}]},
     "messages[0].colour"),
    ("/v1/chat/completions", {**CHAT_BODY, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}]}]},
     "messages[0].content[0].cache_control"),
    ("/v1/chat/completions", {**CHAT_BODY, "stream": True, "stream_options": {"include_usage": True, "x": 1}},
     "stream_options.x"),
    ("/v1/chat/completions", {**CHAT_BODY, "Weird-Key": 1}, "Weird-Key"),
    ("/v1/completions", {**COMPLETION, "best_of_all": 3}, "best_of_all"),
    ("/v1/completions", {**COMPLETION, "use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {**COMPLETION, "safety_identifier": "u1"}, "safety_identifier"),   # chat and responses only
    ("/v1/responses", {**RESPONSES_BODY, "frobnicate": True}, "frobnicate"),
    ("/v1/responses", {**RESPONSES_BODY, "input": [{"role": "user", "content": "x", "mood": "ok"}]}, "input[0].mood"),
    ("/v1/responses", {**RESPONSES_BODY, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "x", "lang": "en"}]}]}, "input[0].content[0].lang"),
    ("/v1/context", {**COMPLETION, "frobnicate": 1}, "frobnicate"),
    ("/v1/context", {**CHAT_BODY, "frobnicate": 1}, "frobnicate"),
    ("/tokenize", {"model": MODEL, "prompt": "x", "frobnicate": 1}, "frobnicate"),
    ("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages[0].extra"),
    ("/detokenize", {"model": MODEL, "tokens": [1], "frobnicate": 1}, "frobnicate"),
]


@pytest.mark.parametrize(("path", "body", "param"), UNKNOWN, ids=[f"{p}:{f}" for p, _, f in UNKNOWN])
def test_unknown_fields_are_refused_by_name(tiny_client: httpx.Client, path: str, body: dict[str, Any],
                                            param: str) -> None:
    assert_error(tiny_client.post(path, json=body), 400, param=param, contains=(UNRECOGNIZED_FIELD.format(param),))


QUERIES: list[tuple[str, str, dict[str, Any] | None, str]] = [
    # (method, URL, body, the parameter refused)
    ("POST", "/v1/chat/completions?stream=true", CHAT_BODY, "stream"),
    ("POST", "/v1/completions?max_tokens=9", COMPLETION, "max_tokens"),
    ("POST", "/v1/responses?store=true", RESPONSES_BODY, "store"),
    ("POST", "/tokenize?add_special_tokens=false", {"model": MODEL, "prompt": "x"}, "add_special_tokens"),
    ("GET", "/v1/models?limit=1", None, "limit"),
    ("GET", "/v1/context?after=x", None, "after"),
    ("GET", "/health?verbose=1", None, "verbose"),
    ("GET", "/metrics?name[]=x", None, "name[]"),
    ("POST", "/reset_prefix_cache?reset_everything=true", None, "reset_everything"),
]


@pytest.mark.parametrize(("method", "url", "body", "param"), QUERIES, ids=[u for _, u, _, _ in QUERIES])
def test_query_parameters_a_route_does_not_take_are_refused_by_name(
        tiny_client: httpx.Client, method: str, url: str, body: dict[str, Any] | None, param: str) -> None:
    answer = tiny_client.request(method, url, json=body)
    assert_error(answer, 400, param=param, contains=(f"Unknown query parameter '{param}': {url.split('?')[0]}",))


STRAY: list[tuple[str, dict[str, Any], str]] = [
    # A field of another kind of content part on a text part: declared, so refused by its path.
    ("/v1/chat/completions", {**CHAT_BODY, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "image_url": {"url": "http://x"}}]}]}, "messages[0].content[0].image_url"),
    ("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "file": {"file_id": "f"}}]}]}, "messages[0].content[0].file"),
    ("/v1/responses", {**RESPONSES_BODY, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "x", "image_url": "http://x"}]}]}, "input[0].content[0].image_url"),
]


@pytest.mark.parametrize(("path", "body", "param"), STRAY, ids=[f"{p}:{f}" for p, _, f in STRAY])
def test_another_part_kinds_field_on_a_text_part_is_refused(tiny_client: httpx.Client, path: str,
                                                            body: dict[str, Any], param: str) -> None:
    assert_error(tiny_client.post(path, json=body), 400, param=param, contains=("does not belong",))


def test_no_op_fields_answer_200(tiny_client: httpx.Client) -> None:
    assert set(NO_OP_FIELDS) == {"user", "safety_identifier", "service_tier", "store", "metadata"}
    chat = {**CHAT_BODY, "user": "u1", "safety_identifier": "u1", "prompt_cache_key": "agent-7",
            "service_tier": "auto", "store": True, "metadata": {"run": "7"},
            "max_completion_tokens": CHAT_BODY["max_tokens"]}          # both limits, one value
    for path, body in [("/v1/chat/completions", chat), ("/v1/completions", {**COMPLETION, "user": "u1"}),
                       ("/v1/responses", {**RESPONSES_BODY, "user": "u1", "safety_identifier": "u1",
                                          "prompt_cache_key": "k", "service_tier": "default"})]:
        r = tiny_client.post(path, json=body)
        assert r.status_code == 200, (path, r.text)
    # Two different limits: one would be ignored.
    assert_error(tiny_client.post("/v1/chat/completions", json={**CHAT_BODY, "max_completion_tokens": 3}), 400,
                 param="max_tokens", code="invalid_parameter_combination")


BAD_BOUNDS: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"repetition_penalty": 11.0}, "repetition_penalty"),
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"min_p": 1.5}, "min_p"),
    ("/v1/completions", {"min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {"min_tokens": 5}, "min_tokens"),                  # above max_tokens 2
    ("/v1/completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"999999999": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": "high"}}, "logit_bias"),
    ("/v1/completions", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/completions", {"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ("/v1/completions", {"truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens"),
    ("/v1/completions", {"truncate_prompt_tokens": 3, "echo": True}, "truncate_prompt_tokens"),
    ("/v1/completions", {"skip_special_tokens": "no"}, "skip_special_tokens"),
    ("/v1/completions", {"user": "u" * 300}, "user"),
    ("/v1/completions", {"stop": [f"s{i}" for i in range(65)]}, "stop"),
    ("/v1/completions", {"stop": "s" * 1025}, "stop"),
    ("/v1/chat/completions", {"stop": ["ok", "s" * 1025]}, "stop[1]"),
    ("/v1/completions", {"stop_token_ids": [5] * 1025}, "stop_token_ids"),
    ("/v1/chat/completions", {"cache_salt": "c" * 1025}, "cache_salt"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"chat_template_kwargs": {f"k{i}": 1 for i in range(33)}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ("/v1/chat/completions", {"store": "yes"}, "store"),
]


@pytest.mark.parametrize(("path", "extra", "param"), BAD_BOUNDS, ids=[f"{p}:{f}" for p, _, f in BAD_BOUNDS])
def test_extras_out_of_bounds_are_refused_by_name(tiny_client: httpx.Client, path: str, extra: dict[str, Any],
                                                  param: str) -> None:
    base = COMPLETION if path == "/v1/completions" else CHAT_BODY
    assert_error(tiny_client.post(path, json={**base, **extra}), 400, param=param)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_a_scheduling_priority_is_refused_under_fcfs_never_ignored(tiny_client: httpx.Client, path: str) -> None:
    base = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT_BODY}.get(path, RESPONSES_BODY)
    assert_error(tiny_client.post(path, json={**base, "priority": 1}), 400, param="priority")
    assert tiny_client.post(path, json={**base, "priority": 0}).status_code == 200


def token_id(client: httpx.Client, text: str) -> int:
    r = client.post("/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False})
    ids = r.json()["tokens"]
    assert len(ids) == 1, ids
    return ids[0]


def complete(client: httpx.Client, **body: Any) -> dict[str, Any]:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon a time", "temperature": 0,
                                             **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_logit_bias_stop_strings_and_special_tokens(tiny_client: httpx.Client) -> None:
    hello = token_id(tiny_client, " hello")
    forced = complete(tiny_client, max_tokens=3, logit_bias={str(hello): 100})
    assert forced["choices"][0]["text"] == " hello" * 3
    cut = complete(tiny_client, max_tokens=3, logit_bias={str(hello): 100}, stop=" hello")
    kept = complete(tiny_client, max_tokens=3, logit_bias={str(hello): 100}, stop=" hello",
                    include_stop_str_in_output=True)
    assert cut["choices"][0]["text"] == "" and kept["choices"][0]["text"] == " hello"
    assert cut["choices"][0]["finish_reason"] == kept["choices"][0]["finish_reason"] == "stop"
    start = token_id(tiny_client, "<|im_start|>")
    skipped = complete(tiny_client, max_tokens=2, logit_bias={str(start): 100}, ignore_eos=True)
    written = complete(tiny_client, max_tokens=2, logit_bias={str(start): 100}, ignore_eos=True,
                       skip_special_tokens=False)
    assert skipped["choices"][0]["text"] == "" and written["choices"][0]["text"] == "<|im_start|>" * 2


def test_min_tokens_holds_eos_and_stop_strings_back(tiny_client: httpx.Client) -> None:
    eos = token_id(tiny_client, "<|im_end|>")
    ended = complete(tiny_client, max_tokens=8, logit_bias={str(eos): 100})
    assert ended["usage"]["completion_tokens"] == 1 and ended["choices"][0]["finish_reason"] == "stop"
    held = complete(tiny_client, max_tokens=8, logit_bias={str(eos): 100}, min_tokens=3)
    assert held["usage"]["completion_tokens"] == 4 and held["choices"][0]["finish_reason"] == "stop"
    hello = token_id(tiny_client, " hello")
    # A stop string counts only after min_tokens tokens: the first two " hello" go out.
    text = complete(tiny_client, max_tokens=4, logit_bias={str(hello): 100}, stop=" hello", min_tokens=2)
    assert text["choices"][0]["text"] == " hello" * 2


def test_truncate_prompt_tokens_keeps_the_last_tokens(tiny_client: httpx.Client) -> None:
    whole = complete(tiny_client, max_tokens=1)
    assert whole["usage"]["prompt_tokens"] > 3
    cut = complete(tiny_client, max_tokens=1, truncate_prompt_tokens=3)
    assert cut["usage"]["prompt_tokens"] == 3
    chat = tiny_client.post("/v1/chat/completions", json={**CHAT_BODY, "truncate_prompt_tokens": 4})
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == 4


def test_chat_template_kwargs_reach_the_template(tiny_client: httpx.Client) -> None:
    # The default model's template reads no extra variable: the prompt is the same, and accepted.
    plain = tiny_client.post("/v1/chat/completions", json=CHAT_BODY).json()
    extra = tiny_client.post("/v1/chat/completions", json={**CHAT_BODY, "chat_template_kwargs": {
        "enable_thinking": False}})
    assert extra.status_code == 200, extra.text
    assert extra.json()["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
