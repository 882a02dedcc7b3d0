"""The HTTP API over real HTTP: a tiny random-weight model behind the real tokenizer, in a subprocess."""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import httpx
import pytest
from support.api import LONG_PROMPT, MODEL, chat, complete, stream
from support.servers import TINY_API_KEY, TINY_MAX_MODEL_LEN, ServerProcess

from kvhive.core.model_files import default_model_path
from kvhive.core.tokenizer import Tokenizer


def assert_usage(usage: dict[str, Any]) -> None:
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert isinstance(usage["prompt_tokens_details"]["cached_tokens"], int)
    assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]


def test_health_models_and_open_endpoints(tiny_server: ServerProcess, tiny_client: httpx.Client) -> None:
    assert httpx.get(f"{tiny_server.base_url}/health").status_code == 200       # no key needed
    assert httpx.get(f"{tiny_server.base_url}/metrics").status_code == 200
    models = tiny_client.get("/v1/models").json()
    assert models["object"] == "list"
    (card,) = models["data"]
    assert card["id"] == MODEL and card["object"] == "model" and card["max_model_len"] == TINY_MAX_MODEL_LEN


def test_completion_response_shape(tiny_client: httpx.Client) -> None:
    body = complete(tiny_client, prompt="Once upon a time", max_tokens=5, temperature=0, ignore_eos=True)
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", body["id"])
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert isinstance(body["created"], int) and abs(body["created"] - time.time()) < 60
    (choice,) = body["choices"]
    assert choice["index"] == 0 and isinstance(choice["text"], str) and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5
    assert_usage(body["usage"])


def test_prompt_forms_agree(tiny_client: httpx.Client) -> None:
    text = complete(tiny_client, prompt="The quick brown fox", max_tokens=4, temperature=0, ignore_eos=True)
    ids = Tokenizer.from_model_path(default_model_path()).encode("The quick brown fox")
    assert text["usage"]["prompt_tokens"] == len(ids)
    for prompt in (ids, [ids], ["The quick brown fox"]):
        other = complete(tiny_client, prompt=prompt, max_tokens=4, temperature=0, ignore_eos=True)
        assert other["choices"][0]["text"] == text["choices"][0]["text"]
        assert other["usage"]["prompt_tokens"] == len(ids)


def test_chat_stream_events_and_agreement(tiny_client: httpx.Client) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    whole = chat(tiny_client, messages=messages, max_tokens=8, temperature=0, ignore_eos=True)
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", whole["id"]) and whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"]["role"] == "assistant"
    assert_usage(whole["usage"])
    events = stream(tiny_client, "/v1/chat/completions", messages=messages, max_tokens=8, temperature=0,
                    ignore_eos=True, stream_options={"include_usage": True})
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if isinstance(e, dict)]
    assert len(chunks) == len(events) - 1
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["usage"] is None for c in chunks[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert_usage(usage_chunk["usage"])
    assert usage_chunk["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"] == 8
    finish = chunks[-2]["choices"][0]
    assert finish["finish_reason"] == "length" and finish["delta"] == {}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert text == whole["choices"][0]["message"]["content"]


def test_completion_stream_without_usage(tiny_client: httpx.Client) -> None:
    whole = complete(tiny_client, prompt="Hello", max_tokens=6, temperature=0, ignore_eos=True)
    events = stream(tiny_client, "/v1/completions", prompt="Hello", max_tokens=6, temperature=0,
                    ignore_eos=True)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all("usage" not in c and c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]


def _stop_string_of(text: str) -> tuple[str, str]:
    """A stop string taken from the middle of ``text`` and the text expected before it."""
    middle = len(text) // 2
    stop = text[middle:middle + 3]
    assert stop.strip(), f"no usable stop string in {text!r}"
    return stop, text[:text.find(stop)]


def test_stop_strings(tiny_client: httpx.Client) -> None:
    prompt = "Write a long story about dragons"
    full = complete(tiny_client, prompt=prompt, max_tokens=24, temperature=0, ignore_eos=True)
    stop, expected = _stop_string_of(full["choices"][0]["text"])
    cut = complete(tiny_client, prompt=prompt, max_tokens=24, temperature=0, ignore_eos=True,
                   stop=["never-generated-zzz", stop])
    assert cut["choices"][0] == {"index": 0, "text": expected, "logprobs": None, "finish_reason": "stop"}
    assert cut["usage"]["completion_tokens"] < 24
    events = stream(tiny_client, "/v1/completions", prompt=prompt, max_tokens=24, temperature=0,
                    ignore_eos=True, stop=stop, stream_options={"include_usage": True})
    texts = [c["choices"][0]["text"] for c in events[:-2]]
    assert "".join(texts) == expected and not any(stop in t for t in texts)
    assert events[-3]["choices"][0]["finish_reason"] == "stop"
    assert events[-2]["usage"]["completion_tokens"] == cut["usage"]["completion_tokens"]


def test_max_tokens_defaults_to_the_rest_of_the_context(tiny_client: httpx.Client) -> None:
    body = complete(tiny_client, prompt="Count:", temperature=0, ignore_eos=True)
    usage = body["usage"]
    assert body["choices"][0]["finish_reason"] == "length"
    assert usage["prompt_tokens"] + usage["completion_tokens"] == TINY_MAX_MODEL_LEN


def test_prefix_cache_hits_and_cache_salt(tiny_server: ServerProcess, tiny_client: httpx.Client) -> None:
    hits_before = tiny_server.metric("kvhive_prefix_cache_hits_total")
    first = complete(tiny_client, prompt=LONG_PROMPT, max_tokens=2, temperature=0)
    second = complete(tiny_client, prompt=LONG_PROMPT, max_tokens=2, temperature=0)
    assert first["usage"]["prompt_tokens"] >= 64
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48
    assert tiny_server.metric("kvhive_prefix_cache_hits_total") > hits_before
    salted = complete(tiny_client, prompt=LONG_PROMPT, max_tokens=2, temperature=0, cache_salt="tenant-a")
    assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again = complete(tiny_client, prompt=LONG_PROMPT, max_tokens=2, temperature=0, cache_salt="tenant-a")
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48


def test_seed_reproducibility(tiny_client: httpx.Client) -> None:
    def sample(seed: int) -> str:
        return complete(tiny_client, prompt="Random words:", max_tokens=8, temperature=1.0, seed=seed,
                        ignore_eos=True)["choices"][0]["text"]

    assert sample(1234) == sample(1234)
    assert sample(1234) != sample(4321)


def test_concurrent_requests_get_unique_ids(tiny_client: httpx.Client) -> None:
    results: list[dict[str, Any]] = []

    def one(i: int) -> None:
        results.append(complete(tiny_client, prompt=f"Request number {i}", max_tokens=6, ignore_eos=True))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 6 and len({r["id"] for r in results}) == 6
    assert all(r["usage"]["completion_tokens"] == 6 for r in results)


def _wait_for_abort(server: ServerProcess, aborts_before: float) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        aborted = server.metric("kvhive_request_finished_total", {"finished_reason": "abort"})
        if aborted > aborts_before and server.metric("kvhive_num_requests_running") == 0:
            return
        time.sleep(0.05)
    pytest.fail("the request of a disconnected client was not aborted")


def test_streaming_client_disconnect_aborts(tiny_server: ServerProcess, tiny_client: httpx.Client) -> None:
    aborts = tiny_server.metric("kvhive_request_finished_total", {"finished_reason": "abort"})
    with tiny_client.stream("POST", "/v1/completions", json={
            "model": MODEL, "prompt": "Go on forever", "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
    # Leaving the block closed the connection before the ~250 tokens were generated.
    _wait_for_abort(tiny_server, aborts)


def test_non_streaming_client_disconnect_aborts(tiny_server: ServerProcess) -> None:
    aborts = tiny_server.metric("kvhive_request_finished_total", {"finished_reason": "abort"})
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{tiny_server.base_url}/v1/chat/completions", timeout=0.2,
                   headers={"Authorization": f"Bearer {TINY_API_KEY}"},
                   json={"model": MODEL, "messages": [{"role": "user", "content": "Talk a lot"}],
                         "ignore_eos": True})
    _wait_for_abort(tiny_server, aborts)


def test_metrics_exposition(tiny_server: ServerProcess, tiny_client: httpx.Client) -> None:
    complete(tiny_client, prompt="metrics please", max_tokens=3, ignore_eos=True)
    r = httpx.get(f"{tiny_server.base_url}/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    m = tiny_server.metric
    assert m("kvhive_request_finished_total", {"finished_reason": "length", "model_name": MODEL}) >= 1
    assert m("kvhive_time_to_first_token_seconds_count") >= 1
    assert m("kvhive_inter_token_latency_seconds_count") >= 2
    assert m("kvhive_prompt_tokens_total") >= 2 and m("kvhive_generation_tokens_total") >= 3
    assert m("kvhive_prefix_cache_queries_total") >= m("kvhive_prefix_cache_hits_total") >= 0
    assert 0 <= m("kvhive_kv_cache_usage_perc") <= 1
    assert m("kvhive_cache_block_size") == 16 and m("kvhive_cache_num_blocks") > 0
    for name in ("kvhive_num_requests_running", "kvhive_num_requests_waiting", "kvhive_num_preemptions_total"):
        assert re.search(rf"^{name}\{{", r.text, re.M), name
