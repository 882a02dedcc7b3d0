"""End to end: the official ``openai`` client against ``kvhive`` serving the real default model."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai import OpenAI
from support.servers import ServerProcess

MODEL = "smollm2-135m"
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
# ~250 tokens: long enough that a repeat is served mostly from the prefix cache.
LONG_SYSTEM = "You are a meticulous assistant for a geography quiz. " + " ".join(
    f"Rule {i}: answer with facts about country number {i} only when asked." for i in range(20))


def test_models_list(openai_client: OpenAI) -> None:
    (model,) = openai_client.models.list().data
    assert model.id == MODEL
    assert model.model_extra["max_model_len"] == 2048


def test_chat_non_streaming(openai_client: OpenAI) -> None:
    r = openai_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    (choice,) = r.choices
    assert choice.message.role == "assistant" and "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_streaming_with_usage(openai_client: OpenAI) -> None:
    whole = openai_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0)
    chunks = list(openai_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert last.usage.prompt_tokens_details.cached_tokens > 0          # the same prompt ran just before
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_streaming_and_not(openai_client: OpenAI) -> None:
    prompt = "The three primary colours are"
    whole = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert whole.id.startswith("cmpl-") and whole.choices[0].text.strip()
    assert whole.usage.prompt_tokens_details.cached_tokens >= 0
    chunks = list(openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_repeated_long_prompt_is_served_from_the_prefix_cache(openai_client: OpenAI) -> None:
    messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "Which rule is first?"}]
    first = openai_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    second = openai_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens > 200
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 32, (cached, first.usage.prompt_tokens)
    assert second.choices[0].message.content == first.choices[0].message.content


def test_stop_strings(openai_client: OpenAI) -> None:
    full = openai_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    text = full.choices[0].message.content
    words = text.split()
    assert len(words) >= 3, text
    stop = " " + words[len(words) // 2]
    expected = text[:text.find(stop)]
    cut = openai_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0, stop=stop)
    assert cut.choices[0].message.content == expected
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < full.usage.completion_tokens
    chunks = list(openai_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0,
                                                 stop=[stop], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_reproducibility(openai_client: OpenAI) -> None:
    def sample(seed: int) -> str:
        r = openai_client.completions.create(model=MODEL, prompt="My favourite animal is", max_tokens=10,
                                      temperature=1.0, seed=seed)
        return r.choices[0].text

    assert sample(7) == sample(7)


def test_logprobs_and_n(openai_client: OpenAI) -> None:
    r = openai_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, temperature=0.8, seed=3,
                                       n=2, logprobs=True, top_logprobs=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    for choice in r.choices:
        joined = b"".join(bytes(t.bytes) for t in choice.logprobs.content).decode(errors="replace")
        assert joined.startswith(choice.message.content)       # plus the end-of-turn token, if it came
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in choice.logprobs.content)
    whole = openai_client.completions.create(model=MODEL, prompt="The three primary colours are", max_tokens=5,
                                      temperature=0, logprobs=3)
    lp = whole.choices[0].logprobs
    assert "".join(lp.tokens) == whole.choices[0].text
    assert [next(iter(top)) for top in lp.top_logprobs] == lp.tokens      # greedy: the top-1 token


def test_wrong_api_key_is_rejected(default_server: ServerProcess, openai_client: OpenAI) -> None:
    bad = OpenAI(base_url=f"{default_server.base_url}/v1", api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    with pytest.raises(openai.NotFoundError):
        openai_client.chat.completions.create(model="gpt-4o", messages=QUESTION, max_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, n=17)
    assert info.value.param == "n"
    assert openai_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2).usage.completion_tokens


def test_continue_final_message_goes_on_from_an_assistant_prefill(openai_client: OpenAI,
                                                                   default_server: ServerProcess) -> None:
    prefill = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    opening = {"add_generation_prompt": False, "continue_final_message": True}
    r = openai_client.chat.completions.create(model=MODEL, messages=prefill, max_tokens=8, temperature=0,
                                              extra_body=opening)
    text = r.choices[0].message.content
    assert "Paris" in text and not text.startswith("The capital")       # only what follows the prefill
    streamed = openai_client.chat.completions.create(model=MODEL, messages=prefill, max_tokens=8, temperature=0,
                                                     extra_body=opening, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text
    # The prompt ends inside the assistant turn: its ids are /tokenize's, and their greedy
    # continuation is the same text.
    ids = httpx.post(f"{default_server.base_url}/tokenize", timeout=60, json={"model": MODEL, "messages": prefill,
                                                                               **opening},
                     headers={"authorization": f"Bearer {openai_client.api_key}"}).json()["tokens"]
    assert r.usage.prompt_tokens == len(ids)
    assert openai_client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0).choices[0].text == text
    # vLLM's echo: the content starts with the prefill (streamed as its own first piece).
    echoed = openai_client.chat.completions.create(model=MODEL, messages=prefill, max_tokens=8, temperature=0,
                                                   extra_body={**opening, "echo": True})
    assert echoed.choices[0].message.content == prefill[-1]["content"] + text
    pieces = [c.choices[0].delta.content for c in openai_client.chat.completions.create(
        model=MODEL, messages=prefill, max_tokens=8, temperature=0, extra_body={**opening, "echo": True},
        stream=True) if c.choices and c.choices[0].delta.content]
    assert pieces[0] == prefill[-1]["content"] and "".join(pieces) == prefill[-1]["content"] + text
    unechoed = openai_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, temperature=0,
                                                     extra_body={"echo": True})     # the last message is the user's
    assert unechoed.choices[0].message.content == openai_client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=4, temperature=0).choices[0].message.content
    # Ending after the last message (no generation prompt) is a prompt of its own.
    closed = openai_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, temperature=0,
                                                   extra_body={"add_generation_prompt": False})
    plain = openai_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, temperature=0)
    assert closed.usage.prompt_tokens < plain.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as both:
        openai_client.chat.completions.create(model=MODEL, messages=prefill, max_tokens=4,
                                              extra_body={"continue_final_message": True})
    assert both.value.body["param"] == "continue_final_message"
