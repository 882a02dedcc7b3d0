"""``/v1/responses`` over real HTTP on the tiny-model server: create, continue from kept KV, branch,
stream, fetch, list input items, delete, ownership, expiry, one request at a time, bad input."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from support.servers import (
    FAULT_MARKER,
    SERVED_MODEL_NAME,
    SLOW_MARKER,
    ServerProcess,
    start_server,
    stop_server,
)

from kvhive.sessions.response_store import conversation_of

RESPONSE_EVENTS_HEAD = ["response.created", "response.in_progress", "response.output_item.added",
                        "response.content_part.added"]
LOGPROBS = "message.output_text.logprobs"
RESPONSE_EVENTS_TAIL = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def create(client: httpx.Client, input: Any = None, **fields: Any) -> httpx.Response:
    """POST /v1/responses with greedy sampling and a short output unless told otherwise."""
    body = {"model": SERVED_MODEL_NAME, "input": input if input is not None else f"Say {uuid.uuid4().hex}",
            "max_output_tokens": 6, "temperature": 0, **fields}
    return client.post("/v1/responses", json=body)


def ok(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    return response.json()


def text_of(response: dict[str, Any]) -> str:
    (message,) = response["output"]
    return "".join(part["text"] for part in message["content"])


def cached(response: dict[str, Any]) -> int:
    return response["usage"]["input_tokens_details"]["cached_tokens"]


def whole_blocks_before_last(response: dict[str, Any]) -> int:
    """The tokens of a response's prompt in whole blocks before its last token: the least a next
    turn reuses, since re-rendering the history may tokenise that last token (the assistant
    header's newline) together with the reply."""
    return (response["usage"]["input_tokens"] - 1) // 16 * 16


def uncached_chat(client: httpx.Client, messages: list[dict[str, str]], max_tokens: int = 6) -> str:
    """The greedy reply of /v1/chat/completions to the whole history, computed without any cache."""
    body = {"model": SERVED_MODEL_NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "cache_salt": uuid.uuid4().hex}
    answer = client.post("/v1/chat/completions", json=body).json()
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    return answer["choices"][0]["message"]["content"]


def read_events(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    """(event line, data) of each event of a Responses-API stream."""
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[len("data: "):])))
            name = None
        else:
            assert line == "", line
    return events


def test_create_continue_fetch_list_and_delete(tiny_client: httpx.Client) -> None:
    first = create(tiny_client, "Hello there", instructions="Be brief.", metadata={"topic": "greeting"},
                   user="u-1")
    r1 = ok(first)
    assert r1["id"].startswith("resp_") and first.headers["x-kvhive-response-id"] == r1["id"]
    assert (r1["object"], r1["status"], r1["error"], r1["store"]) == ("response", "incomplete", None, True)
    assert r1["incomplete_details"] == {"reason": "max_output_tokens"}      # 6 tokens of a random model
    assert (r1["instructions"], r1["metadata"], r1["user"]) == ("Be brief.", {"topic": "greeting"}, "u-1")
    assert (r1["max_output_tokens"], r1["temperature"], r1["top_p"]) == (6, 0.0, 1.0)
    assert (r1["previous_response_id"], r1["tools"], r1["text"]) == (None, [], {"format": {"type": "text"}})
    (message,) = r1["output"]
    assert message["type"] == "message" and message["id"].startswith("msg_")
    assert (message["role"], message["status"]) == ("assistant", "incomplete")
    assert message["content"] == [{"type": "output_text", "text": text_of(r1), "annotations": [], "logprobs": []}]
    usage = r1["usage"]
    assert usage["output_tokens"] == 6 and usage["output_tokens_details"] == {"reasoning_tokens": 0}
    assert usage["total_tokens"] == usage["input_tokens"] + 6 and cached(r1) == 0

    assert ok(tiny_client.get(f"/v1/responses/{r1['id']}")) == r1
    items = ok(tiny_client.get(f"/v1/responses/{r1['id']}/input_items"))
    (item,) = items["data"]
    assert item["type"] == "message" and item["role"] == "user"
    assert item["content"] == [{"type": "input_text", "text": "Hello there"}]
    assert (items["object"], items["first_id"], items["last_id"], items["has_more"]) == \
        ("list", item["id"], item["id"], False)

    r2 = ok(create(tiny_client, "And then?", previous_response_id=r1["id"], instructions="Be brief."))
    assert r2["previous_response_id"] == r1["id"] and r2["id"] != r1["id"]
    assert cached(r2) >= whole_blocks_before_last(r1) > 0
    # The same history sent whole to chat completions, without cache, gives the same greedy text.
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"},
               {"role": "assistant", "content": text_of(r1)}, {"role": "user", "content": "And then?"}]
    assert text_of(r2) == uncached_chat(tiny_client, history)

    deleted = ok(tiny_client.delete(f"/v1/responses/{r2['id']}"))
    assert deleted == {"id": r2["id"], "object": "response", "deleted": True}
    for path in (f"/v1/responses/{r2['id']}", f"/v1/responses/{r2['id']}/input_items"):
        gone = tiny_client.get(path)
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "response_not_found"
    assert tiny_client.delete(f"/v1/responses/{r2['id']}").status_code == 404
    missing = create(tiny_client, "More", previous_response_id=r2["id"])
    assert missing.status_code == 404
    assert missing.json()["error"]["param"] == "previous_response_id"
    # r1 is still there: its conversation keeps its session.
    assert ok(tiny_client.get(f"/v1/responses/{r1['id']}")) == r1
    session = ok(tiny_client.get(f"/v1/context/{conversation_of(r1['id'])}"))
    assert session["tokens"] > 0
    ok(tiny_client.delete(f"/v1/responses/{r1['id']}"))
    # The last response of the conversation is gone: its session (and KV) with it.
    assert tiny_client.get(f"/v1/context/{conversation_of(r1['id'])}").status_code == 404


def test_cached_tokens_grow_over_a_three_turn_chain(tiny_client: httpx.Client) -> None:
    # Instructions of its own (sent on every turn: they are not carried over) make the first
    # prompt block new to the shared server, whatever ran before.
    system = f"You are storyteller {uuid.uuid4().hex}."
    r1 = ok(create(tiny_client, "Tell me a story about a fox " * 4, instructions=system))
    r2 = ok(create(tiny_client, "Go on", previous_response_id=r1["id"], instructions=system))
    r3 = ok(create(tiny_client, "And the end?", previous_response_id=r2["id"], instructions=system))
    assert cached(r1) == 0
    # Each turn finds the previous prompt (all of it from the session; when the re-rendered history
    # differs from the session's tokens, at least its whole blocks), so cached tokens grow.
    assert cached(r2) >= whole_blocks_before_last(r1)
    assert cached(r3) >= whole_blocks_before_last(r2)
    assert cached(r3) > cached(r2) > cached(r1)
    items = [ok(tiny_client.get(f"/v1/responses/{r['id']}/input_items"))["data"] for r in (r1, r2, r3)]
    assert [[i["content"][0]["text"] for i in page] for page in items] == \
        [["Tell me a story about a fox " * 4], ["Go on"], ["And the end?"]]


def test_branches_from_one_response_are_each_correct(tiny_client: httpx.Client) -> None:
    r1 = ok(create(tiny_client, "Pick a color"))
    base = [{"role": "user", "content": "Pick a color"}, {"role": "assistant", "content": text_of(r1)}]
    a = ok(create(tiny_client, "Why red?", previous_response_id=r1["id"]))
    # The session now holds branch a; branch b diverges from it and falls back to prefix matching.
    b = ok(create(tiny_client, "Why blue?", previous_response_id=r1["id"]))
    a2 = ok(create(tiny_client, "Really?", previous_response_id=a["id"]))     # back on branch a
    assert text_of(a) == uncached_chat(tiny_client, [*base, {"role": "user", "content": "Why red?"}])
    assert text_of(b) == uncached_chat(tiny_client, [*base, {"role": "user", "content": "Why blue?"}])
    assert text_of(a2) == uncached_chat(tiny_client, [
        *base, {"role": "user", "content": "Why red?"}, {"role": "assistant", "content": text_of(a)},
        {"role": "user", "content": "Really?"}])
    assert cached(b) >= whole_blocks_before_last(r1)
    assert cached(a2) >= whole_blocks_before_last(r1)


def test_streaming_events_in_order_and_stored(tiny_client: httpx.Client) -> None:
    r1 = ok(create(tiny_client, "Count with me"))
    body = {"model": SERVED_MODEL_NAME, "input": "One, two", "previous_response_id": r1["id"],
            "max_output_tokens": 8, "temperature": 0, "stream": True}
    with tiny_client.stream("POST", "/v1/responses", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = read_events(response)
    names = [name for name, _ in events]
    assert all(name == data["type"] for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    deltas = [data for _, data in events if data["type"] == "response.output_text.delta"]
    assert names == [*RESPONSE_EVENTS_HEAD, *["response.output_text.delta"] * len(deltas),
                     *RESPONSE_EVENTS_TAIL, "response.incomplete"]
    created, final = events[0][1]["response"], events[-1][1]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["id"] == final["id"]
    assert response.headers["x-kvhive-response-id"] == final["id"]
    text = "".join(d["delta"] for d in deltas)
    item_id = final["output"][0]["id"]
    assert all((d["item_id"], d["output_index"], d["content_index"]) == (item_id, 0, 0) for d in deltas)
    assert events[-4][1]["text"] == text == text_of(final)
    assert events[-2][1]["item"] == final["output"][0]
    assert final["usage"]["output_tokens"] == 8 and cached(final) >= whole_blocks_before_last(r1)
    # The streamed response is stored, and the same request whole gives the same text.
    assert ok(tiny_client.get(f"/v1/responses/{final['id']}")) == final
    whole = ok(create(tiny_client, "One, two", previous_response_id=r1["id"], max_output_tokens=8))
    assert text_of(whole) == text


def test_store_false_keeps_nothing_and_leaves_the_conversation_as_it_was(tiny_client: httpx.Client) -> None:
    r1 = ok(create(tiny_client, "Remember the number 41"))
    aside = create(tiny_client, "What number?", previous_response_id=r1["id"], store=False)
    unstored = ok(aside)
    assert unstored["store"] is False and "x-kvhive-response-id" not in aside.headers
    assert cached(unstored) >= whole_blocks_before_last(r1)     # the session's blocks, by prefix
    assert tiny_client.get(f"/v1/responses/{unstored['id']}").status_code == 404
    assert create(tiny_client, "More", previous_response_id=unstored["id"]).status_code == 404
    # The session still holds r1's conversation, not the unstored turn.
    session = ok(tiny_client.get(f"/v1/context/{conversation_of(r1['id'])}"))
    assert session["tokens"] == r1["usage"]["total_tokens"]
    r2 = ok(create(tiny_client, "What number?", previous_response_id=r1["id"]))
    assert text_of(r2) == text_of(unstored)


def test_a_request_on_a_busy_conversation_runs_beside_its_session(tiny_client: httpx.Client) -> None:
    r1 = ok(create(tiny_client, "Start"))
    r2 = ok(create(tiny_client, "Next", previous_response_id=r1["id"]))
    # A turn that lasts seconds (SLOW_MARKER): while it runs, the conversation's session is busy.
    body = {"model": SERVED_MODEL_NAME, "input": "A long answer please " + SLOW_MARKER, "previous_response_id": r2["id"],
            "max_output_tokens": 200, "temperature": 0, "stream": True}
    conversation = conversation_of(r1["id"])
    with tiny_client.stream("POST", "/v1/responses", json=body) as running:
        lines = running.iter_lines()
        while not next(lines).startswith("data: {\"type\": \"response.output_text.delta\""):
            pass
        assert tiny_client.get(f"/v1/context/{conversation}").json()["busy"]
        # Follow-ups of any response of the conversation run at once, beside the session, and are
        # stored in the conversation; prefix caching finds what the conversation computed.
        beside = {previous["id"]: ok(create(tiny_client, "Me too", previous_response_id=previous["id"]))
                  for previous in (r2, r1)}
        for previous_id, answer in beside.items():
            assert answer["previous_response_id"] == previous_id
            assert conversation_of(answer["id"]) == conversation
            assert answer["usage"]["input_tokens_details"]["cached_tokens"] >= 16
            assert ok(tiny_client.get(f"/v1/responses/{answer['id']}"))["id"] == answer["id"]
        assert tiny_client.get(f"/v1/context/{conversation}").json()["busy"]     # still the running turn's
    # The client left: the turn was aborted and the conversation is free again.
    deadline = time.monotonic() + 10
    while tiny_client.get(f"/v1/context/{conversation}").json()["busy"] and time.monotonic() < deadline:
        time.sleep(0.05)
    after = ok(create(tiny_client, "And now?", previous_response_id=beside[r2["id"]]["id"]))
    assert after["usage"]["input_tokens_details"]["cached_tokens"] > 0
    session = ok(tiny_client.get(f"/v1/context/{conversation}"))
    assert session["tokens"] == after["usage"]["total_tokens"]          # the session follows it


def test_a_first_turn_the_client_leaves_stores_nothing_and_ends_its_session(tiny_client: httpx.Client) -> None:
    body = {"model": SERVED_MODEL_NAME, "input": "A long story please", "max_output_tokens": 200,
            "temperature": 0, "stream": True}
    with tiny_client.stream("POST", "/v1/responses", json=body) as running:
        lines = running.iter_lines()
        while not (line := next(lines)).startswith("data: "):
            pass
        response_id = json.loads(line[len("data: "):])["response"]["id"]
        conversation = conversation_of(response_id)
        assert ok(tiny_client.get(f"/v1/context/{conversation}"))["busy"] is True
    deadline = time.monotonic() + 10
    while tiny_client.get(f"/v1/context/{conversation}").status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tiny_client.get(f"/v1/context/{conversation}").status_code == 404
    assert tiny_client.get(f"/v1/responses/{response_id}").status_code == 404


def chat_logprobs(client: httpx.Client, messages: list[dict[str, str]], top: int, max_tokens: int = 6
                  ) -> list[dict[str, Any]]:
    """The token logprobs /v1/chat/completions gives for the greedy reply to ``messages``, uncached."""
    body = {"model": SERVED_MODEL_NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "logprobs": True, "top_logprobs": top, "cache_salt": uuid.uuid4().hex}
    return ok(client.post("/v1/chat/completions", json=body))["choices"][0]["logprobs"]["content"]


def assert_same_logprobs(got: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    """The same tokens, strings, bytes and alternatives; values equal up to float noise (the KV of a
    continued turn comes from the cache, the reference's is computed anew)."""
    def strip(entries: list[dict[str, Any]]) -> list[Any]:
        return [(e["token"], e["bytes"], [(t["token"], t["bytes"]) for t in e["top_logprobs"]]) for e in entries]

    def values(entries: list[dict[str, Any]]) -> list[float]:
        return [v for e in entries for v in (e["logprob"], *(t["logprob"] for t in e["top_logprobs"]))]

    assert strip(got) == strip(expected)
    assert values(got) == pytest.approx(values(expected), abs=1e-4)


def test_logprobs_are_the_ones_chat_gives_for_the_same_conversation(tiny_client: httpx.Client) -> None:
    question = f"Spell {uuid.uuid4().hex}"
    r1 = ok(create(tiny_client, question, include=[LOGPROBS], top_logprobs=3))
    assert r1["top_logprobs"] == 3
    (part,) = r1["output"][0]["content"]
    assert len(part["logprobs"]) == r1["usage"]["output_tokens"] == 6
    assert all(len(entry["top_logprobs"]) == 3 for entry in part["logprobs"])
    messages = [{"role": "user", "content": question}]
    assert_same_logprobs(part["logprobs"], chat_logprobs(tiny_client, messages, 3))
    # A turn continued from the conversation's kept KV: the logprobs of the whole history sent to chat.
    r2 = ok(create(tiny_client, "Again", previous_response_id=r1["id"], include=[LOGPROBS]))
    messages += [{"role": "assistant", "content": part["text"]}, {"role": "user", "content": "Again"}]
    expected = chat_logprobs(tiny_client, messages, 0)
    assert_same_logprobs(r2["output"][0]["content"][0]["logprobs"], expected)
    assert all(entry["top_logprobs"] == [] for entry in expected)
    # Stored with the response; asking for none gives none.
    assert ok(tiny_client.get(f"/v1/responses/{r2['id']}")) == r2
    plain = ok(create(tiny_client, "Again", previous_response_id=r1["id"], store=False))
    assert plain["output"][0]["content"][0]["logprobs"] == [] and plain["top_logprobs"] == 0


def test_streamed_deltas_carry_the_logprobs_of_their_tokens(tiny_client: httpx.Client) -> None:
    question = f"Stream {uuid.uuid4().hex}"
    whole = ok(create(tiny_client, question, include=[LOGPROBS], top_logprobs=2, max_output_tokens=12,
                      store=False))
    body = {"model": SERVED_MODEL_NAME, "input": question, "include": [LOGPROBS], "top_logprobs": 2,
            "max_output_tokens": 12, "temperature": 0, "stream": True}
    with tiny_client.stream("POST", "/v1/responses", json=body) as response:
        events = [data for _, data in read_events(response)]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    final = events[-1]["response"]
    streamed = [entry for d in deltas for entry in d["logprobs"]]
    expected = final["output"][0]["content"][0]["logprobs"]
    assert len(expected) == 12 and streamed == expected
    (done,) = [e for e in events if e["type"] == "response.output_text.done"]
    assert done["logprobs"] == expected
    # Each delta's tokens are the ones whose text starts in it.
    assert all(d["delta"] or d["logprobs"] for d in deltas)
    assert_same_logprobs(expected, whole["output"][0]["content"][0]["logprobs"])


def wait_until(condition: Any, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def stream_events(client: httpx.Client, **fields: Any) -> list[dict[str, Any]]:
    body = {"model": SERVED_MODEL_NAME, "max_output_tokens": 8, "temperature": 0, "stream": True, **fields}
    with client.stream("POST", "/v1/responses", json=body) as response:
        assert response.status_code == 200
        return [data for _, data in read_events(response)]       # OpenAI framing only: no [DONE]


def test_an_engine_error_mid_stream_ends_it_with_response_failed_and_stores_nothing(
        tiny_client: httpx.Client) -> None:
    r1 = ok(create(tiny_client, "Keep this"))
    conversation = conversation_of(r1["id"])
    events = stream_events(tiny_client, input=f"Now fail {FAULT_MARKER}", previous_response_id=r1["id"])
    names = [e["type"] for e in events]
    assert names == [*RESPONSE_EVENTS_HEAD, *["response.output_text.delta"] * (len(names) - 5), "response.failed"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["id"] == events[0]["response"]["id"]
    assert failed["error"]["code"] == "server_error"
    assert "injected engine failure mid-way" in failed["error"]["message"]
    assert tiny_client.get(f"/v1/responses/{failed['id']}").status_code == 404
    # The conversation's session holds r1's turn as before, free for the next request.
    assert wait_until(lambda: not tiny_client.get(f"/v1/context/{conversation}").json()["busy"])
    assert ok(tiny_client.get(f"/v1/context/{conversation}"))["tokens"] == r1["usage"]["total_tokens"]
    r2 = ok(create(tiny_client, "Go on", previous_response_id=r1["id"]))
    assert text_of(r2) == uncached_chat(tiny_client, [
        {"role": "user", "content": "Keep this"}, {"role": "assistant", "content": text_of(r1)},
        {"role": "user", "content": "Go on"}])
    # A failed first turn stores nothing and ends the session of its new conversation.
    events = stream_events(tiny_client, input=f"Fail at once {FAULT_MARKER}")
    assert events[-1]["type"] == "response.failed"
    first = conversation_of(events[-1]["response"]["id"])
    assert wait_until(lambda: tiny_client.get(f"/v1/context/{first}").status_code == 404)
    assert tiny_client.get(f"/v1/responses/{events[-1]['response']['id']}").status_code == 404


def test_an_engine_error_unstreamed_is_a_500_and_stores_nothing(tiny_client: httpx.Client) -> None:
    r1 = ok(create(tiny_client, "Keep this too"))
    for fields in ({"previous_response_id": r1["id"]}, {}):
        failed = create(tiny_client, f"Fail {FAULT_MARKER}", **fields)
        assert failed.status_code == 500 and "x-kvhive-response-id" not in failed.headers
        error = failed.json()["error"]
        assert error["type"] == "server_error" and "injected engine failure mid-way" in error["message"]
    conversation = conversation_of(r1["id"])
    session = ok(tiny_client.get(f"/v1/context/{conversation}"))
    assert session["busy"] is False and session["tokens"] == r1["usage"]["total_tokens"]
    ok(create(tiny_client, "Go on", previous_response_id=r1["id"]))


BAD_BODIES = [
    ({"tools": [{"type": "web_search_preview"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]}, "tools[0].parameters"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"include": [LOGPROBS, "message.input_image.image_url"]}, "include"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"top_logprobs": 3}, "top_logprobs"),                              # without include
    ({"include": [LOGPROBS], "top_logprobs": 21}, "top_logprobs"),
    ({"include": [LOGPROBS], "top_logprobs": -1}, "top_logprobs"),
    ({"conversation": "conv_123"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "message", "role": "user"}]}, "input[0].content"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 100000}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"store": "yes"}, "store"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k": "v" * 513}}, "metadata"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_BODIES, ids=[p for _, p in BAD_BODIES])
def test_bad_input_answers_400_naming_the_field(tiny_client: httpx.Client, fields: dict[str, Any],
                                                param: str) -> None:
    response = create(tiny_client, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_unknown_ids_model_and_header_answer_openai_errors(tiny_client: httpx.Client) -> None:
    for previous in ("resp_" + "0" * 48, "resp_nope", "chatcmpl-1"):
        response = create(tiny_client, previous_response_id=previous)
        assert response.status_code == 404
        assert response.json()["error"] == {
            "message": response.json()["error"]["message"], "type": "invalid_request_error",
            "param": "previous_response_id", "code": "previous_response_not_found"}
    assert create(tiny_client, model="gpt-5").status_code == 404
    with_header = tiny_client.post("/v1/responses", headers={"x-session-id": "s"},
                                   json={"model": SERVED_MODEL_NAME, "input": "x", "max_output_tokens": 2})
    assert with_header.status_code == 400 and with_header.json()["error"]["param"] == "x-session-id"
    r1 = ok(create(tiny_client))
    assert tiny_client.get(f"/v1/responses/{r1['id']}/input_items", params={"limit": 0}).status_code == 400
    assert tiny_client.get(f"/v1/responses/{r1['id']}/input_items", params={"order": "up"}).status_code == 400
    assert tiny_client.get(f"/v1/responses/{r1['id']}/input_items", params={"after": "msg_x"}).status_code == 400


def test_input_item_forms_and_paging(tiny_client: httpx.Client) -> None:
    items = [{"role": "developer", "content": "Answer in French."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"},
                                                              {"type": "input_text", "text": "there"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Salut"}]},
             {"role": "user", "content": "How are you?"}]
    r1 = ok(create(tiny_client, items))
    assert text_of(r1) == uncached_chat(tiny_client, [
        {"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi\nthere"},
        {"role": "assistant", "content": "Salut"}, {"role": "user", "content": "How are you?"}])
    path = f"/v1/responses/{r1['id']}/input_items"
    newest_first = ok(tiny_client.get(path))["data"]
    assert [i["role"] for i in newest_first] == ["user", "assistant", "user", "developer"]
    assert newest_first[1]["content"] == [{"type": "output_text", "text": "Salut", "annotations": []}]
    page = ok(tiny_client.get(path, params={"order": "asc", "limit": 2}))
    assert [i["role"] for i in page["data"]] == ["developer", "user"] and page["has_more"] is True
    rest = ok(tiny_client.get(path, params={"order": "asc", "after": page["last_id"]}))
    assert [i["role"] for i in rest["data"]] == ["assistant", "user"] and rest["has_more"] is False


def test_expiry_slides_with_each_turn_then_frees_the_conversation(tiny_client: httpx.Client) -> None:
    r = ok(create(tiny_client, "Short-lived"))
    conversation = conversation_of(r["id"])
    # A 2 s TTL on the conversation's session; each turn slides both the session and its responses.
    ok(tiny_client.patch(f"/v1/context/{conversation}", json={"ttl": 2}))
    chain = [r]
    for _ in range(3):
        time.sleep(1.0)
        chain.append(ok(create(tiny_client, "Still here?", previous_response_id=chain[-1]["id"])))
    assert ok(tiny_client.get(f"/v1/responses/{chain[0]['id']}"))["id"] == chain[0]["id"]    # 3 s after it
    time.sleep(3.5)
    for response in chain:
        assert tiny_client.get(f"/v1/responses/{response['id']}").status_code == 404
    assert tiny_client.get(f"/v1/context/{conversation}").status_code == 404
    assert create(tiny_client, previous_response_id=chain[-1]["id"]).status_code == 404


# ---------------------------------------------------------------- two API keys, a session limit

KEY_A, KEY_B = "responses-key-a", "responses-key-b"


@pytest.fixture(scope="module")
def keyed_server() -> Iterator[ServerProcess]:
    server = start_server("tiny", api_keys=(KEY_A, KEY_B), max_model_len=512,
                          extra_args=("--max-sessions-per-key", "2"))
    yield server
    stop_server(server)


def keyed(server: ServerProcess, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, timeout=60, headers={"Authorization": f"Bearer {key}"})


def test_a_response_belongs_to_the_key_that_created_it(keyed_server: ServerProcess) -> None:
    with keyed(keyed_server, KEY_A) as a, keyed(keyed_server, KEY_B) as b:
        r1 = ok(create(a, "Mine"))
        for path in (f"/v1/responses/{r1['id']}", f"/v1/responses/{r1['id']}/input_items"):
            other = b.get(path)
            assert other.status_code == 404 and other.json()["error"]["code"] == "response_not_found"
        assert b.delete(f"/v1/responses/{r1['id']}").status_code == 404
        stolen = create(b, "Yours?", previous_response_id=r1["id"])
        assert stolen.status_code == 404 and stolen.json()["error"]["param"] == "previous_response_id"
        ok(a.get(f"/v1/responses/{r1['id']}"))
        ok(a.delete(f"/v1/responses/{r1['id']}"))
    with httpx.Client(base_url=keyed_server.base_url) as anonymous:
        assert anonymous.get(f"/v1/responses/{r1['id']}").status_code == 401


def test_conversations_per_key_are_bounded_by_the_session_limit(keyed_server: ServerProcess) -> None:
    with keyed(keyed_server, KEY_B) as b:
        first, second = ok(create(b, "One")), ok(create(b, "Two"))
        third = create(b, "Three")
        assert third.status_code == 429 and third.json()["error"]["code"] == "too_many_sessions"
        # Continuing a conversation adds no session; store: false needs none.
        ok(create(b, "One more", previous_response_id=first["id"]))
        ok(create(b, "Three", store=False))
        # Deleting a conversation's responses ends its session and makes room.
        ok(b.delete(f"/v1/responses/{second['id']}"))
        ok(create(b, "Three"))


def test_metrics_count_stored_responses_conversations_and_created_by_status() -> None:
    server = start_server("tiny", max_model_len=512, faulty=True)       # its own: nothing else runs there
    try:
        def stored() -> tuple[float, float]:
            return server.metric("kvhive_responses_stored"), server.metric("kvhive_response_conversations")

        def created(status: str) -> float:
            return server.metric("kvhive_responses_created_total", {"status": status})

        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            assert stored() == (0, 0) and created("incomplete") == 0
            r1 = ok(create(client, "One"))
            r2 = ok(create(client, "Two", previous_response_id=r1["id"]))
            other = ok(create(client, "Another conversation", max_output_tokens=64))
            assert stored() == (3, 2)
            ok(create(client, "Not kept", store=False))
            assert stored() == (3, 2)
            statuses = [r["status"] for r in (r1, r2, other)] + ["incomplete"]
            for status in ("completed", "incomplete"):
                assert created(status) == statuses.count(status)
            assert create(client, f"Fail {FAULT_MARKER}").status_code == 500
            assert stream_events(client, input=f"Fail {FAULT_MARKER}")[-1]["type"] == "response.failed"
            assert created("failed") == 2 and stored() == (3, 2)
            ok(client.delete(f"/v1/responses/{r2['id']}"))
            assert stored() == (2, 2)
            ok(client.delete(f"/v1/responses/{r1['id']}"))
            assert stored() == (1, 1)
            assert server.metric("kvhive_responses_created_total", {"status": "failed",
                                                                    "model_name": SERVED_MODEL_NAME}) == 2
    finally:
        stop_server(server)
