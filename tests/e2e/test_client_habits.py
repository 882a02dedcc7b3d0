"""What evaluation, training and browser clients do besides plain requests, over real HTTP: a list of
prompts in one completion (OpenAI's batch form), ``GET /v1/models/{id}``, vLLM's ``return_token_ids``,
``prompt_logprobs`` and ``continuous_usage_stats``, ``stream_options`` without a stream, opt-in CORS
and ``GET /tokenizer_info``; with httpx and the ``openai`` SDK.

Most checks run on the session's tiny server (no CORS, no /tokenizer_info); one module server adds
CORS, /tokenizer_info and a served name holding '/'.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from support.api import MODEL, assert_error, chat, complete, stream
from support.servers import TINY_API_KEY, ServerProcess, start_server, stop_server

from kvhive.core.tokenizer import Tokenizer

GREEDY = {"temperature": 0, "ignore_eos": True}
PROMPTS = ["The capital of France is", "One, two, three, four,"]
ORIGIN = "https://app.example"
SLASHED = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def browser_server() -> Iterator[ServerProcess]:
    """A tiny server with CORS for ORIGIN, /tokenizer_info, and a served name holding '/'."""
    server = start_server("tiny", api_keys=(TINY_API_KEY,), extra_args=(
        "--served-model-name", SLASHED, "--allowed-origins", f'["{ORIGIN}"]', "--enable-tokenizer-info-endpoint"))
    yield server
    stop_server(server)


@pytest.fixture()
def browser_client(browser_server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=browser_server.base_url, timeout=120,
                      headers={"Authorization": f"Bearer {TINY_API_KEY}"}) as client:
        yield client


def texts_by_index(choices: list[dict[str, Any]]) -> dict[int, str]:
    return {c["index"]: c["text"] for c in choices}


# ---------------------------------------------------------------- several prompts in one completion


def test_a_list_of_prompts_answers_n_choices_per_prompt_in_order(tiny_client: httpx.Client,
                                                                  tokenizer: Tokenizer) -> None:
    singles = [complete(tiny_client, prompt=p, max_tokens=3, **GREEDY) for p in PROMPTS]
    batch = complete(tiny_client, prompt=PROMPTS, max_tokens=3, n=2, **GREEDY)
    assert sorted(c["index"] for c in batch["choices"]) == [0, 1, 2, 3]
    texts = texts_by_index(batch["choices"])
    for p, single in enumerate(singles):
        for j in range(2):                     # greedy: every choice of a prompt is its single answer
            assert texts[p * 2 + j] == single["choices"][0]["text"]
    usage = batch["usage"]
    assert usage["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
    assert usage["completion_tokens"] == 2 * 2 * 3
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    as_ids = complete(tiny_client, prompt=[tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS],
                      max_tokens=3, **GREEDY)
    assert texts_by_index(as_ids["choices"]) == {p: s["choices"][0]["text"] for p, s in enumerate(singles)}


def test_a_streamed_list_of_prompts_tags_each_chunk_with_its_choice(tiny_client: httpx.Client) -> None:
    whole = complete(tiny_client, prompt=PROMPTS, max_tokens=4, **GREEDY)
    events = stream(tiny_client, "/v1/completions", prompt=PROMPTS, max_tokens=4,
                    stream_options={"include_usage": True}, **GREEDY)
    assert events[-1] == "[DONE]"
    joined: dict[int, str] = {}
    finished = set()
    for event in events[:-2]:
        for choice in event["choices"]:
            joined[choice["index"]] = joined.get(choice["index"], "") + choice["text"]
            if choice["finish_reason"] is not None:
                finished.add(choice["index"])
    assert joined == texts_by_index(whole["choices"]) and finished == {0, 1}
    assert events[-2]["choices"] == [] and events[-2]["usage"] == whole["usage"]


def test_echo_and_logprobs_apply_to_each_prompt(tiny_client: httpx.Client, tokenizer: Tokenizer) -> None:
    body = complete(tiny_client, prompt=PROMPTS, max_tokens=2, echo=True, logprobs=1, **GREEDY)
    for choice in body["choices"]:
        prompt = PROMPTS[choice["index"]]
        assert choice["text"].startswith(prompt)
        tokens = choice["logprobs"]["tokens"]
        assert len(tokens) == len(tokenizer.encode(prompt, add_special_tokens=True)) + 2
        assert choice["logprobs"]["token_logprobs"][0] is None
    # lm-evaluation-harness's loglikelihood requests: token-id prompts scored, nothing generated.
    ids = [tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS]
    scored = complete(tiny_client, prompt=ids, max_tokens=0, echo=True, logprobs=1, **GREEDY)
    assert sorted(c["index"] for c in scored["choices"]) == [0, 1]
    for choice in scored["choices"]:
        assert len(choice["logprobs"]["token_logprobs"]) == len(ids[choice["index"]])
        assert choice["finish_reason"] == "length"
    assert scored["usage"]["completion_tokens"] == 0
    assert scored["usage"]["prompt_tokens"] == sum(map(len, ids))


def test_a_list_of_prompts_is_bounded_and_never_in_a_session(tiny_client: httpx.Client) -> None:
    r = tiny_client.post("/v1/completions", json={"model": MODEL, "prompt": ["a"] * 65})
    assert_error(r, 400, param="prompt", contains=("64",))
    r = tiny_client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPTS},
                         headers={"x-session-id": "some-session"})
    assert_error(r, 400, param="prompt", contains=("session",))


def test_the_openai_sdk_sends_a_list_of_prompts_and_retrieves_the_model(tiny_server: ServerProcess) -> None:
    from openai import NotFoundError, OpenAI

    client = OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key=TINY_API_KEY, max_retries=0, timeout=120)
    answer = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=2, temperature=0)
    assert sorted(c.index for c in answer.choices) == [0, 1]
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    with pytest.raises(NotFoundError):
        client.models.retrieve("no-such-model")


# ---------------------------------------------------------------- GET /v1/models/{id}


def test_a_model_card_by_id_and_404_for_another(tiny_client: httpx.Client) -> None:
    (listed,) = tiny_client.get("/v1/models").json()["data"]
    assert tiny_client.get(f"/v1/models/{MODEL}").json() == listed
    assert_error(tiny_client.get("/v1/models/other-model"), 404, param="model", code="model_not_found")
    assert_error(tiny_client.get("/v1/models/org/other-model"), 404, param="model", code="model_not_found")


def test_a_model_id_with_a_slash(browser_server: ServerProcess, browser_client: httpx.Client) -> None:
    from openai import OpenAI

    r = browser_client.get(f"/v1/models/{SLASHED}")
    assert r.status_code == 200 and r.json()["id"] == SLASHED
    client = OpenAI(base_url=f"{browser_server.base_url}/v1", api_key=TINY_API_KEY, max_retries=0, timeout=60)
    assert client.models.retrieve(SLASHED).id == SLASHED


# ---------------------------------------------------------------- vLLM's fields


def test_return_token_ids_on_completions_whole_and_streamed(tiny_client: httpx.Client,
                                                            tokenizer: Tokenizer) -> None:
    prompt = PROMPTS[0]
    whole = complete(tiny_client, prompt=prompt, max_tokens=5, return_token_ids=True, **GREEDY)
    (choice,) = whole["choices"]
    assert choice["prompt_token_ids"] == tokenizer.encode(prompt, add_special_tokens=True)
    assert len(choice["token_ids"]) == whole["usage"]["completion_tokens"] == 5
    assert tokenizer.decode(choice["token_ids"]) == choice["text"]
    events = stream(tiny_client, "/v1/completions", prompt=prompt, max_tokens=5, return_token_ids=True, **GREEDY)
    chunks = [c for e in events[:-1] for c in e["choices"]]
    assert chunks[0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == choice["token_ids"]
    plain = complete(tiny_client, prompt=prompt, max_tokens=2, **GREEDY)
    assert not {"token_ids", "prompt_token_ids", "prompt_logprobs"} & set(plain["choices"][0])


def test_return_token_ids_on_chat_whole_and_streamed(tiny_client: httpx.Client, tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Say hello"}]
    whole = chat(tiny_client, messages=messages, max_tokens=5, return_token_ids=True, **GREEDY)
    assert whole["prompt_token_ids"] == tokenizer.encode_chat(messages)
    (choice,) = whole["choices"]
    assert len(choice["token_ids"]) == whole["usage"]["completion_tokens"]
    events = stream(tiny_client, "/v1/chat/completions", messages=messages, max_tokens=5, return_token_ids=True,
                    **GREEDY)
    assert events[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all("prompt_token_ids" not in e for e in events[1:-1])
    assert [t for e in events[:-1] for c in e["choices"] for t in c.get("token_ids", [])] == choice["token_ids"]


def test_prompt_logprobs_on_completions_and_chat(tiny_client: httpx.Client, tokenizer: Tokenizer) -> None:
    prompt = PROMPTS[1]
    ids = tokenizer.encode(prompt, add_special_tokens=True)
    echoed = complete(tiny_client, prompt=prompt, max_tokens=1, echo=True, logprobs=2, **GREEDY)
    scored = complete(tiny_client, prompt=prompt, max_tokens=1, prompt_logprobs=2, **GREEDY)
    values = scored["choices"][0]["prompt_logprobs"]
    assert len(values) == len(ids) and values[0] is None
    expected = echoed["choices"][0]["logprobs"]["token_logprobs"][1:len(ids)]
    for position, (token_id, value) in enumerate(zip(ids[1:], expected, strict=True), start=1):
        entry = values[position]
        assert 1 <= len(entry) <= 3
        assert entry[str(token_id)]["logprob"] == pytest.approx(value, abs=1e-4)
        ranks = sorted(e["rank"] for e in entry.values() if e["rank"] is not None)
        assert ranks[:2] == [1, 2]
    assert scored["choices"][0]["logprobs"] is None                  # the prompt's, not the completion's
    assert "prompt_logprobs" not in echoed["choices"][0]
    both = complete(tiny_client, prompt=prompt, max_tokens=1, echo=True, logprobs=1, prompt_logprobs=3, **GREEDY)
    (choice,) = both["choices"]
    assert all(len(top) <= 2 for top in choice["logprobs"]["top_logprobs"][1:])   # each field its own count
    assert all(3 <= len(entry) <= 4 for entry in choice["prompt_logprobs"][1:])
    messages = [{"role": "user", "content": "Hello"}]
    answer = chat(tiny_client, messages=messages, max_tokens=1, prompt_logprobs=0, **GREEDY)
    chat_values = answer["prompt_logprobs"]
    chat_ids = tokenizer.encode_chat(messages)
    assert len(chat_values) == len(chat_ids) and chat_values[0] is None
    assert all(list(v)[0] == str(t) for v, t in zip(chat_values[1:], chat_ids[1:], strict=True))
    r = tiny_client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                       "prompt_logprobs": 1, "stream": True})
    assert_error(r, 400, param="prompt_logprobs")


def test_continuous_usage_stats_put_usage_on_every_chunk(tiny_client: httpx.Client) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    for path, fields in (("/v1/completions", {"prompt": PROMPTS[0]}),
                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        events = stream(tiny_client, path, max_tokens=4, stream_options=options, **GREEDY, **fields)
        chunks = [e for e in events[:-1] if e["choices"]]
        assert chunks and all(e["usage"] is not None for e in chunks)
        produced = [e["usage"]["completion_tokens"] for e in chunks]
        assert produced == sorted(produced) and produced[-1] == 4
        assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 4
        r = tiny_client.post(path, json={"model": MODEL, "stream": True, "max_tokens": 2, **fields,
                                         "stream_options": {"continuous_usage_stats": True}})
        assert_error(r, 400, param="stream_options.continuous_usage_stats")


def test_stream_options_without_a_stream_is_refused(tiny_client: httpx.Client) -> None:
    for path, fields in (("/v1/completions", {"prompt": "x"}),
                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        r = tiny_client.post(path, json={"model": MODEL, "max_tokens": 1, **fields,
                                         "stream_options": {"include_usage": True}})
        assert_error(r, 400, param="stream_options")


# ---------------------------------------------------------------- CORS and /tokenizer_info


def test_cors_is_off_by_default(tiny_server: ServerProcess, tiny_client: httpx.Client) -> None:
    r = tiny_client.get("/v1/models", headers={"Origin": ORIGIN})
    assert r.status_code == 200 and not any(h.startswith("access-control-") for h in r.headers)
    preflight = httpx.options(f"{tiny_server.base_url}/v1/chat/completions",
                              headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in preflight.headers


def test_cors_preflight_and_actual_requests(browser_server: ServerProcess, browser_client: httpx.Client) -> None:
    preflight = httpx.options(f"{browser_server.base_url}/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code == 200                 # answered before the API key is asked for
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    stranger = httpx.options(f"{browser_server.base_url}/v1/chat/completions", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in stranger.headers
    r = browser_client.post("/v1/completions", headers={"Origin": ORIGIN},
                            json={"model": SLASHED, "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    assert "x-session-id" in r.headers["access-control-expose-headers"]


def test_tokenizer_info_only_when_enabled(tiny_client: httpx.Client, browser_client: httpx.Client,
                                          tokenizer: Tokenizer) -> None:
    assert tiny_client.get("/tokenizer_info").status_code == 404
    info = browser_client.get("/tokenizer_info").json()
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tokenizer.chat_template is not None and info["chat_template"] == tokenizer.chat_template.source
    assert info["eos_token"] == tokenizer.special_tokens["eos_token"]
    assert info["bos_token_id"] == tokenizer.bos_token_id and info["vocab_size"] == tokenizer.vocab_size
    assert httpx.get(f"{browser_client.base_url}/tokenizer_info").status_code == 401   # API key needed
