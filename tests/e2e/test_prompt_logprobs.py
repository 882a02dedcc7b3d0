"""Prompt logprobs (``echo`` + ``logprobs`` on /v1/completions, for scoring) over real HTTP on the tiny
server, every value checked against the log-softmax of a dense reference forward of the same random
weights (in the engine itself: tests/engine/test_prompt_logprobs_engine.py)."""

from __future__ import annotations

import uuid

import httpx
import pytest
from support.api import MODEL
from support.servers import read_sse
from support.tiny import prompt_reference, tiny_config, tiny_model

from kvhive.core.tokenizer import Tokenizer
from kvhive.model.llama import LlamaModel
from kvhive.server.logprobs import token_string

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def reference(tokenizer: Tokenizer) -> LlamaModel:
    """The tiny server's model (same config and seed as support/serve_faulty.py builds it)."""
    return tiny_model(tiny_config(vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_ids=tokenizer.eos_token_ids))


def unique_prompt() -> str:
    """A prompt no other test sent: its blocks start out uncached on the shared server."""
    return f"Score this sentence {uuid.uuid4().hex} about the weather in Paris today."


def completion(client: httpx.Client, **fields) -> dict:
    r = client.post("/v1/completions", json={"model": MODEL, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def assert_prompt_part(lp: dict, text: str, prompt_ids: list[int], tokenizer: Tokenizer,
                       model: LlamaModel, num_top: int) -> None:
    """The first len(prompt_ids) entries of a choice's logprobs are the prompt's, right."""
    n = len(prompt_ids)
    assert lp["tokens"][:n] == [token_string(tokenizer.token_bytes(t)) for t in prompt_ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = prompt_reference(model, prompt_ids)
    assert lp["token_logprobs"][1:n] == pytest.approx(
        [ref[i, t].item() for i, t in enumerate(prompt_ids[1:])], abs=1e-3)
    for i in range(1, n):
        top = lp["top_logprobs"][i]
        ids = ref[i - 1].topk(num_top).indices.tolist()
        assert set(top) == {token_string(tokenizer.token_bytes(t)) for t in [*ids, prompt_ids[i]]}
        assert top[lp["tokens"][i]] == pytest.approx(lp["token_logprobs"][i], abs=1e-6)
    # Offsets into the echoed text: each (ASCII) token's text starts there.
    assert lp["text_offset"][:n] == sorted(lp["text_offset"][:n])
    for token, offset in zip(lp["tokens"][:n], lp["text_offset"][:n], strict=True):
        assert text[offset:].startswith(token)


def test_echo_logprobs_score_the_prompt_cached_or_not(tiny_client: httpx.Client, tokenizer: Tokenizer,
                                                      reference: LlamaModel) -> None:
    prompt = unique_prompt()
    ids = tokenizer.encode(prompt)
    scored = {"prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 3, **GREEDY}
    cold = completion(tiny_client, **scored)
    completion(tiny_client, prompt=prompt, max_tokens=1)       # now its blocks are cached
    warm = completion(tiny_client, **scored)
    for body in (cold, warm):
        (choice,) = body["choices"]
        assert choice["text"].startswith(prompt)
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 3
        assert_prompt_part(lp, choice["text"], ids, tokenizer, reference, 2)
        # Then the generated tokens, their offsets past the echoed prompt.
        assert "".join(lp["tokens"][len(ids):]) == choice["text"][len(prompt):]
        assert lp["text_offset"][len(ids)] == len(prompt)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert body["usage"]["completion_tokens"] == 3
    assert warm["choices"][0]["logprobs"] == cold["choices"][0]["logprobs"]
    # A plain request still finds the blocks in the cache.
    again = completion(tiny_client, prompt=prompt, max_tokens=1)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_max_tokens_zero_with_echo_returns_only_the_scored_prompt(tiny_client: httpx.Client, tokenizer: Tokenizer,
                                                                  reference: LlamaModel) -> None:
    prompt = unique_prompt()
    ids = tokenizer.encode(prompt)
    body = completion(tiny_client, prompt=prompt, echo=True, logprobs=0, max_tokens=0)
    (choice,) = body["choices"]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    assert_prompt_part(choice["logprobs"], prompt, ids, tokenizer, reference, 0)
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(ids)
    # Token ids in, without logprobs: the echoed text alone.
    plain = completion(tiny_client, prompt=ids, echo=True, max_tokens=0)
    assert plain["choices"][0]["text"] == tokenizer.decode(ids, skip_special_tokens=False)
    assert plain["choices"][0]["logprobs"] is None
    # A one-token prompt: its one entry is null, whole or streamed.
    one = completion(tiny_client, prompt=ids[:1], echo=True, logprobs=1, max_tokens=0)["choices"][0]["logprobs"]
    assert one["token_logprobs"] == [None] and one["top_logprobs"] == [None] and one["text_offset"] == [0]
    with tiny_client.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": ids[:1], "echo": True,
                                                             "logprobs": 1, "max_tokens": 0, "stream": True}) as r:
        first = read_sse(r)[0]["choices"][0]["logprobs"]
    assert first == one


def test_streamed_echo_logprobs_come_first_with_the_echo(tiny_client: httpx.Client) -> None:
    prompt = unique_prompt()
    for max_tokens in (0, 4):
        fields = {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": max_tokens, **GREEDY}
        whole = completion(tiny_client, **fields)["choices"][0]
        with tiny_client.stream("POST", "/v1/completions",
                                json={"model": MODEL, "stream": True, **fields}) as r:
            assert r.status_code == 200
            events = read_sse(r)
        assert events[-1] == "[DONE]"
        chunks = [e["choices"][0] for e in events[:-1]]
        assert chunks[0]["text"] == prompt
        assert chunks[0]["logprobs"]["token_logprobs"][0] is None
        assert "".join(c["text"] for c in chunks) == whole["text"]
        assert chunks[-1]["finish_reason"] == whole["finish_reason"]
        for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            streamed = [x for c in chunks if c["logprobs"] for x in c["logprobs"][field]]
            assert streamed == whole["logprobs"][field]


def test_prompt_logprobs_are_refused_in_a_session_and_without_echo_max_tokens_zero(
        tiny_client: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "Score me", "echo": True, "logprobs": 1, "max_tokens": 1}
    refused = [tiny_client.post("/v1/context", json=body, headers={"x-session-ttl": "60"}),
               tiny_client.post("/v1/completions", json=body, headers={"x-session-id": "no-such-session"})]
    for r in refused:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "logprobs" and "session" in r.json()["error"]["message"]
    r = tiny_client.post("/v1/completions", json={**body, "echo": False, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    # The same request outside a session is fine.
    assert tiny_client.post("/v1/completions", json=body).status_code == 200
