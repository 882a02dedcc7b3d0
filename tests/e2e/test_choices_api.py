"""Logprobs, n choices and echo over real HTTP on the tiny model (its logprobs checked against a
dense reference forward of the same random weights)."""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx
import pytest
import torch
from support.api import LONG_PROMPT, MODEL, chat, complete, stream
from support.servers import FAULT_TOKEN_IDS, TINY_API_KEY, ServerProcess
from support.tiny import dense_greedy, dense_logits, tiny_config, tiny_model

from kvhive.core.tokenizer import Tokenizer
from kvhive.model.llama import LlamaModel
from kvhive.server.logprobs import token_string

BLOCK_SIZE = 16            # the tiny server's
GREEDY = {"temperature": 0, "ignore_eos": True}
# Chats here carry their own system message: the template's default one would leave its blocks in
# the shared server's prefix cache, where other test files expect a first chat to find nothing.
SYSTEM = {"role": "system", "content": "Answer in logprobs."}


@pytest.fixture(scope="module")
def reference(tokenizer: Tokenizer) -> LlamaModel:
    """The tiny server's model (same config and seed as support/serve_faulty.py builds it)."""
    return tiny_model(tiny_config(vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_ids=tokenizer.eos_token_ids))


def reference_logprobs(model: LlamaModel, context: list[int]) -> torch.Tensor:
    return torch.log_softmax(dense_logits(model, context)[-1], dim=-1)


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return token_string(tokenizer.token_bytes(token_id))


def chunk_logprobs(events: list[Any], field: str) -> list[Any]:
    """One field of the completion logprobs of every streamed chunk, concatenated."""
    return [x for e in events if isinstance(e, dict) and e["choices"] and e["choices"][0]["logprobs"]
            for x in e["choices"][0]["logprobs"][field]]


def assert_same_chat_logprobs(got: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    """Same tokens and bytes, same values up to float noise (a prefix-cache hit computes the
    prompt's last token through another kernel path)."""

    def flat(entries: list[dict[str, Any]]) -> tuple[list[Any], list[float]]:
        keys = [(e["token"], e["bytes"], [(t["token"], t["bytes"]) for t in e["top_logprobs"]]) for e in entries]
        values = [v for e in entries for v in (e["logprob"], *(t["logprob"] for t in e["top_logprobs"]))]
        return keys, values

    (got_keys, got_values), (keys, values) = flat(got), flat(expected)
    assert got_keys == keys
    assert got_values == pytest.approx(values, abs=1e-4)


def test_completion_logprobs_match_the_reference(tiny_client: httpx.Client, tokenizer: Tokenizer,
                                                 reference: LlamaModel) -> None:
    prompt = tokenizer.encode("The capital of France is")
    body = complete(tiny_client, prompt=prompt, max_tokens=5, logprobs=3, **GREEDY)
    (choice,) = body["choices"]
    lp = choice["logprobs"]
    generated = dense_greedy(reference, prompt, 5)
    assert lp["tokens"] == [token_text(tokenizer, t) for t in generated]
    assert "".join(lp["tokens"]) == choice["text"]
    for i, token in enumerate(generated):
        ref = reference_logprobs(reference, prompt + generated[:i])
        assert lp["token_logprobs"][i] == pytest.approx(ref[token].item(), abs=1e-3)
        values, ids = ref.topk(3)
        top = lp["top_logprobs"][i]
        # The greedy token is the top-1 entry, so the dict holds exactly the top 3.
        assert list(top) == [token_text(tokenizer, t) for t in ids.tolist()]
        assert list(top.values()) == pytest.approx(values.tolist(), abs=1e-3)
        assert next(iter(top)) == lp["tokens"][i]
        assert lp["text_offset"][i] == len("".join(lp["tokens"][:i]))


def test_chat_logprobs_shape_values_and_bytes(tiny_client: httpx.Client, tokenizer: Tokenizer,
                                              reference: LlamaModel) -> None:
    messages = [SYSTEM, {"role": "user", "content": "Tell me about bytes"}]
    body = chat(tiny_client, messages=messages, max_tokens=8, logprobs=True, top_logprobs=2, **GREEDY)
    (choice,) = body["choices"]
    assert choice["logprobs"]["refusal"] is None
    content = choice["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"] == 8
    joined = b"".join(bytes(entry["bytes"]) for entry in content)
    assert joined.decode("utf-8", errors="replace") == choice["message"]["content"]
    prompt = tokenizer.encode_chat(messages)
    first = reference_logprobs(reference, prompt)
    assert content[0]["logprob"] == pytest.approx(first.max().item(), abs=1e-3)
    for entry in content:
        assert entry["token"] == token_string(bytes(entry["bytes"]))
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        top = entry["top_logprobs"]
        assert len(top) == 2 and top[0]["logprob"] >= top[1]["logprob"]
        assert (top[0]["token"], top[0]["logprob"], top[0]["bytes"]) == (entry["token"], entry["logprob"],
                                                                          entry["bytes"])
    without_top = chat(tiny_client, messages=messages, max_tokens=3, logprobs=True, **GREEDY)
    assert [e["top_logprobs"] for e in without_top["choices"][0]["logprobs"]["content"]] == [[]] * 3
    assert chat(tiny_client, messages=messages, max_tokens=3, **GREEDY)["choices"][0]["logprobs"] is None


def test_streamed_completion_logprobs_equal_the_whole_ones_under_a_stop_string(tiny_client: httpx.Client
                                                                                ) -> None:
    fields = {"prompt": "Write a long story about dragons", "max_tokens": 20, "logprobs": 2, **GREEDY}
    full = complete(tiny_client, **fields)["choices"][0]
    text = full["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = complete(tiny_client, stop=stop, **fields)["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["text"] == text[:text.find(stop)]
    tokens = cut["logprobs"]["tokens"]
    # The tokens whose text, or part of it, went out: they cover the text, the last one reaching it.
    assert tokens == full["logprobs"]["tokens"][:len(tokens)]
    assert "".join(tokens).startswith(cut["text"]) and len("".join(tokens[:-1])) < len(cut["text"])
    events = stream(tiny_client, "/v1/completions", stop=stop, **fields)
    for field in ("tokens", "text_offset"):
        assert chunk_logprobs(events, field) == cut["logprobs"][field], field
    assert chunk_logprobs(events, "token_logprobs") == pytest.approx(cut["logprobs"]["token_logprobs"], abs=1e-4)
    tops = chunk_logprobs(events, "top_logprobs")
    assert [list(top) for top in tops] == [list(top) for top in cut["logprobs"]["top_logprobs"]]
    assert [v for top in tops for v in top.values()] == pytest.approx(
        [v for top in cut["logprobs"]["top_logprobs"] for v in top.values()], abs=1e-4)
    # Each chunk carries the tokens whose text starts in it: at every chunk, the tokens so far
    # cover the text so far, the last of them starting inside it.
    text_so_far, tokens_so_far = "", []
    for event in events[:-1]:
        choice = event["choices"][0]
        text_so_far += choice["text"]
        tokens_so_far += choice["logprobs"]["tokens"]
        assert "".join(tokens_so_far).startswith(text_so_far)
        assert len("".join(tokens_so_far[:-1])) < len(text_so_far) or not text_so_far


def test_streamed_chat_logprobs_follow_their_text(tiny_client: httpx.Client) -> None:
    fields = {"messages": [SYSTEM, {"role": "user", "content": "Stream your thoughts"}], "max_tokens": 10,
              "logprobs": True, "top_logprobs": 1, **GREEDY}
    whole = chat(tiny_client, **fields)["choices"][0]
    events = stream(tiny_client, "/v1/chat/completions", **fields)
    choices = [e["choices"][0] for e in events[:-1]]
    assert choices[0]["logprobs"] is None and choices[-1]["logprobs"] is None     # role and finish chunks
    content = [entry for c in choices if c["logprobs"] for entry in c["logprobs"]["content"]]
    assert_same_chat_logprobs(content, whole["logprobs"]["content"])
    for c in choices[1:-1]:
        text = b"".join(bytes(e["bytes"]) for e in c["logprobs"]["content"]).decode("utf-8", errors="replace")
        assert text == c["delta"]["content"]


def test_n_choices_with_a_seed_are_reproducible_and_differ(tiny_client: httpx.Client) -> None:
    fields = {"prompt": "Random words:", "max_tokens": 8, "temperature": 1.0, "seed": 77, "ignore_eos": True}
    first = complete(tiny_client, n=3, **fields)
    again = complete(tiny_client, n=3, **fields)
    single = complete(tiny_client, **fields)
    texts = [c["text"] for c in first["choices"]]
    assert [c["index"] for c in first["choices"]] == [0, 1, 2]
    assert texts == [c["text"] for c in again["choices"]]
    assert len(set(texts)) == 3
    assert texts[0] == single["choices"][0]["text"]           # choice 0 keeps the request's seed
    assert first["usage"]["prompt_tokens"] == single["usage"]["prompt_tokens"]
    assert first["usage"]["completion_tokens"] == 24
    assert first["usage"]["total_tokens"] == first["usage"]["prompt_tokens"] + 24
    unseeded = complete(tiny_client, n=3, **{**fields, "seed": None})
    assert len({c["text"] for c in unseeded["choices"]}) == 3


def test_n_streamed_chat_choices_carry_their_index(tiny_client: httpx.Client) -> None:
    fields = {"messages": [SYSTEM, {"role": "user", "content": "Three ways"}], "n": 3, "max_tokens": 6,
              "temperature": 1.0, "seed": 5, "ignore_eos": True, "logprobs": True}
    whole = chat(tiny_client, **fields)
    events = stream(tiny_client, "/v1/chat/completions", stream_options={"include_usage": True}, **fields)
    assert events[-1] == "[DONE]"
    chunks = events[:-2]
    assert [c["choices"][0]["delta"] for c in chunks[:3]] == [{"role": "assistant", "content": ""}] * 3
    assert [c["choices"][0]["index"] for c in chunks[:3]] == [0, 1, 2]
    for i, choice in enumerate(whole["choices"]):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert "".join(c["delta"].get("content", "") for c in mine) == choice["message"]["content"]
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["length"]
        content = [e for c in mine if c["logprobs"] for e in c["logprobs"]["content"]]
        assert len(content) == 6
        assert_same_chat_logprobs(content, choice["logprobs"]["content"])
    usage = events[-2]["usage"]
    assert events[-2]["choices"] == [] and usage["completion_tokens"] == 18 == whole["usage"]["completion_tokens"]
    assert usage["prompt_tokens"] == whole["usage"]["prompt_tokens"]


def test_greedy_choices_agree_and_share_the_prompt_blocks(tiny_server: ServerProcess,
                                                          tiny_client: httpx.Client) -> None:
    hits = tiny_server.metric("kvhive_prefix_cache_hits_total")
    prompt = f"Run {uuid.uuid4().hex}: {LONG_PROMPT}"
    body = complete(tiny_client, prompt=prompt, n=3, max_tokens=4, **GREEDY)
    assert len({c["text"] for c in body["choices"]}) == 1
    num_prompt = body["usage"]["prompt_tokens"]
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0       # choice 0 found nothing
    # The prompt's full blocks were computed once; the two other choices hit them.
    full_blocks = (num_prompt - 1) // BLOCK_SIZE
    assert tiny_server.metric("kvhive_prefix_cache_hits_total") - hits >= 2 * full_blocks * BLOCK_SIZE


def _wait_for_aborts(server: ServerProcess, before: float, count: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        aborted = server.metric("kvhive_request_finished_total", {"finished_reason": "abort"})
        if aborted >= before + count and server.metric("kvhive_num_requests_running") == 0:
            return
        time.sleep(0.05)
    pytest.fail(f"the {count} choices of a disconnected client were not all aborted")


def test_a_disconnect_aborts_every_choice(tiny_server: ServerProcess, tiny_client: httpx.Client) -> None:
    aborts = tiny_server.metric("kvhive_request_finished_total", {"finished_reason": "abort"})
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{tiny_server.base_url}/v1/completions", timeout=0.3,
                   headers={"Authorization": f"Bearer {TINY_API_KEY}"},
                   json={"model": MODEL, "prompt": "Talk a lot", "n": 3, "ignore_eos": True})
    _wait_for_aborts(tiny_server, aborts, 3)
    aborts = tiny_server.metric("kvhive_request_finished_total", {"finished_reason": "abort"})
    with tiny_client.stream("POST", "/v1/completions", json={
            "model": MODEL, "prompt": "Go on forever", "n": 2, "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
    _wait_for_aborts(tiny_server, aborts, 2)


def test_echo_puts_the_prompt_first(tiny_client: httpx.Client, tokenizer: Tokenizer) -> None:
    fields = {"max_tokens": 4, **GREEDY}
    plain = complete(tiny_client, prompt="Echo me", **fields)["choices"][0]["text"]
    echoed = complete(tiny_client, prompt="Echo me", echo=True, n=2, **fields)
    assert [c["text"] for c in echoed["choices"]] == ["Echo me" + plain] * 2
    assert echoed["usage"]["completion_tokens"] == 8
    ids = [tokenizer.bos_token_id or 0, *tokenizer.encode("Echo me")]
    by_ids = complete(tiny_client, prompt=ids, echo=True, **fields)["choices"][0]["text"]
    assert by_ids.startswith(tokenizer.decode(ids, skip_special_tokens=False))
    events = stream(tiny_client, "/v1/completions", prompt="Echo me", echo=True, **fields)
    assert events[0]["choices"][0]["text"] == "Echo me"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "Echo me" + plain


def test_n_is_refused_in_a_session_and_the_session_survives(tiny_client: httpx.Client) -> None:
    prompt = [(i * 5) % 200 + 3 for i in range(40)]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, **GREEDY}
    r = tiny_client.post("/v1/context", json=body, headers={"x-session-ttl": "60"})
    assert r.status_code == 200, r.text
    sid = r.headers["x-session-id"]
    before = tiny_client.get(f"/v1/context/{sid}").json()
    num_sessions = len(tiny_client.get("/v1/context").json()["data"])
    refused = [
        tiny_client.post("/v1/completions", json={**body, "n": 2}, headers={"x-session-id": sid}),
        tiny_client.post("/v1/context", json={**body, "n": 2}),
        tiny_client.post("/v1/chat/completions", json={"model": MODEL, "n": 2, "conversation_id": "conv-n",
                                                       "messages": [{"role": "user", "content": "hi"}]}),
    ]
    for r in refused:
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "n" and "session" in error["message"]
    assert tiny_client.get("/v1/context/conv-n").status_code == 404
    assert len(tiny_client.get("/v1/context").json()["data"]) == num_sessions
    after = tiny_client.get(f"/v1/context/{sid}").json()
    assert after["tokens"] == before["tokens"] and not after["busy"]
    r = tiny_client.post("/v1/completions", json={**body, "prompt": prompt + [9, 9]}, headers={"x-session-id": sid})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
    assert tiny_client.delete(f"/v1/context/{sid}").status_code == 200


def test_an_engine_error_in_one_choice_fails_the_request(tiny_client: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": FAULT_TOKEN_IDS, "max_tokens": 2, "n": 2}
    r = tiny_client.post("/v1/completions", json=body)
    assert r.status_code == 500 and "injected engine failure" in r.json()["error"]["message"]
    events = stream(tiny_client, "/v1/completions", **{k: v for k, v in body.items() if k != "model"})
    assert events[-1] == "[DONE]" and "injected engine failure" in events[-2]["error"]["message"]
    assert complete(tiny_client, prompt="still here", n=2, max_tokens=2)["usage"]["completion_tokens"] == 4
