"""``/v1/responses`` on the real default model: a chain served from kept KV gives the greedy tokens of
the whole history computed without cache, and the official ``openai`` client drives it."""

from __future__ import annotations

import uuid

import httpx
import pytest
from openai import NotFoundError, OpenAI
from support.servers import DEFAULT_API_KEY, SERVED_MODEL_NAME, ServerProcess

INSTRUCTIONS = "You are a concise assistant. Answer in one short sentence."
TURNS = ["What is the capital of France?", "And of Italy?", "Which of the two is further south?"]


def test_a_chain_from_kept_kv_gives_the_uncached_greedy_tokens(default_server: ServerProcess) -> None:
    with httpx.Client(base_url=default_server.base_url, timeout=120,
                      headers={"Authorization": f"Bearer {DEFAULT_API_KEY}"}) as http:
        messages = [{"role": "system", "content": INSTRUCTIONS}]
        previous = None
        for turn, question in enumerate(TURNS):
            body = {"model": SERVED_MODEL_NAME, "input": question, "instructions": INSTRUCTIONS,
                    "previous_response_id": previous["id"] if previous else None, "max_output_tokens": 24,
                    "temperature": 0}
            response = http.post("/v1/responses", json=body).json()
            text = response["output"][0]["content"][0]["text"]
            messages.append({"role": "user", "content": question})
            reference = http.post("/v1/chat/completions", json={
                "model": SERVED_MODEL_NAME, "messages": messages, "max_tokens": 24, "temperature": 0,
                "cache_salt": uuid.uuid4().hex}).json()      # a fresh salt: nothing cached
            assert reference["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert text == reference["choices"][0]["message"]["content"], f"turn {turn}"
            assert response["usage"]["input_tokens"] == reference["usage"]["prompt_tokens"]
            assert response["usage"]["output_tokens"] == reference["usage"]["completion_tokens"]
            cached = response["usage"]["input_tokens_details"]["cached_tokens"]
            if previous is None:
                assert cached == 0
            else:
                # The session held the whole previous prompt and output; only the last sampled token
                # (never fed back) and the new turn are computed.
                usage = previous["usage"]
                assert cached == usage["input_tokens"] + usage["output_tokens"] - 1
            messages.append({"role": "assistant", "content": text})
            previous = response
    assert "Paris" in messages[2]["content"] and "Rome" in messages[4]["content"]


def test_openai_client_creates_continues_retrieves_and_deletes(openai_client: OpenAI) -> None:
    first = openai_client.responses.create(model=SERVED_MODEL_NAME, input=TURNS[0], instructions=INSTRUCTIONS,
                                    temperature=0, max_output_tokens=32, metadata={"run": "sdk"})
    assert first.object == "response" and first.status == "completed"
    assert "Paris" in first.output_text and first.metadata == {"run": "sdk"}
    second = openai_client.responses.create(model=SERVED_MODEL_NAME, input=TURNS[1], instructions=INSTRUCTIONS,
                                     previous_response_id=first.id, temperature=0, max_output_tokens=32)
    assert second.previous_response_id == first.id and "Rome" in second.output_text
    assert second.usage.input_tokens_details.cached_tokens == \
        first.usage.input_tokens + first.usage.output_tokens - 1
    fetched = openai_client.responses.retrieve(second.id)
    assert fetched.output_text == second.output_text and fetched.usage == second.usage
    (item,) = openai_client.responses.input_items.list(second.id).data
    assert item.role == "user" and item.content[0].text == TURNS[1]
    openai_client.responses.delete(second.id)
    with pytest.raises(NotFoundError):
        openai_client.responses.retrieve(second.id)
    with pytest.raises(NotFoundError):
        openai_client.responses.create(model=SERVED_MODEL_NAME, input="?", previous_response_id=second.id)


def test_openai_client_streams(openai_client: OpenAI) -> None:
    whole = openai_client.responses.create(model=SERVED_MODEL_NAME, input=TURNS[0], temperature=0,
                                    max_output_tokens=32, store=False)
    with openai_client.responses.stream(model=SERVED_MODEL_NAME, input=TURNS[0], temperature=0,
                                 max_output_tokens=32) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == whole.output_text
    assert final.status == "completed" and openai_client.responses.retrieve(final.id).output_text == final.output_text
    # create(stream=True) continuing the streamed response: raw events, then the completed response.
    events = list(openai_client.responses.create(model=SERVED_MODEL_NAME, input=TURNS[1], previous_response_id=final.id,
                                          temperature=0, max_output_tokens=32, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    done = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == done.output_text and "Rome" in text
    assert done.usage.input_tokens_details.cached_tokens == \
        final.usage.input_tokens + final.usage.output_tokens - 1


def test_openai_client_parses_logprobs_equal_to_chat(openai_client: OpenAI) -> None:
    logprobs = ["message.output_text.logprobs"]
    response = openai_client.responses.create(model=SERVED_MODEL_NAME, input=TURNS[0], instructions=INSTRUCTIONS,
                                       temperature=0, max_output_tokens=12, include=logprobs, top_logprobs=2,
                                       store=False)
    (part,) = response.output[0].content
    assert response.top_logprobs == 2 and len(part.logprobs) == response.usage.output_tokens
    chat = openai_client.chat.completions.create(
        model=SERVED_MODEL_NAME, temperature=0, max_tokens=12, logprobs=True, top_logprobs=2,
        messages=[{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": TURNS[0]}])
    expected = chat.choices[0].logprobs.content
    assert [(e.token, e.bytes) for e in part.logprobs] == [(e.token, e.bytes) for e in expected]
    assert [e.logprob for e in part.logprobs] == pytest.approx([e.logprob for e in expected], abs=1e-4)
    assert [[t.token for t in e.top_logprobs] for e in part.logprobs] == \
        [[t.token for t in e.top_logprobs] for e in expected]
    # Streamed: each text delta's logprobs parse, and together they are the whole output's.
    with openai_client.responses.stream(model=SERVED_MODEL_NAME, input=TURNS[0], instructions=INSTRUCTIONS,
                                 temperature=0, max_output_tokens=12, include=logprobs, top_logprobs=2,
                                 store=False) as stream:
        streamed = [lp for event in stream if event.type == "response.output_text.delta" for lp in event.logprobs]
        final = stream.get_final_response()
    assert [(lp.token, lp.logprob) for lp in streamed] == \
        [(lp.token, lp.logprob) for lp in final.output[0].content[0].logprobs]
    assert final.output_text == response.output_text
