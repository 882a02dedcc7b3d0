"""The gateway's forwarding against tiny asyncio servers (in process): which upstream failures are
sent to another replica (once, counted), which are a 502, how a cut stream ends, its body limit;
and what it keeps per API key: session affinity (the prefix store's chunks per key:
tests/engine/test_router_tokenize.py)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from fastapi import Request
from support.upstream_servers import OK, SSE_HEAD, answers, chunk, forward, gateway_for, hangs, sample, served

from kvhive.core.tenancy import key_owner
from kvhive.gateway.app import read_body, too_large
from kvhive.gateway.gateway import REASON_HEADER, REPLICA_HEADER
from kvhive.gateway.upstream import UpstreamClient, UpstreamConnectError, UpstreamError, UpstreamUnanswered
from kvhive.routing.affinity import SessionAffinity
from kvhive.routing.dialects import cut_stream_events


def test_unanswered_failures_are_told_apart_from_answers_that_broke() -> None:
    async def go(urls: list[str]) -> None:
        refused, dropped, half, slow = urls
        client = UpstreamClient(connect_timeout_s=1.0, request_timeout_s=0.3)
        with pytest.raises(UpstreamConnectError) as refused_error:
            await client.send("POST", refused + "/v1/completions", [], b"{}")
        assert refused_error.value.reason == "connect"
        with pytest.raises(UpstreamUnanswered) as dropped_error:
            await client.send("POST", dropped + "/v1/completions", [], b"{}")
        assert dropped_error.value.reason == "reset"
        assert not isinstance(dropped_error.value, UpstreamConnectError)
        for url in (half, slow):            # a status line began, or the replica is still busy
            with pytest.raises(UpstreamError) as error:
                await client.send("POST", url + "/v1/completions", [], b"{}")
            assert not isinstance(error.value, UpstreamUnanswered)
        client.close()

    served(None, answers(), answers(b"HTTP/1.1 200 OK\r\n"), hangs)(go)


def test_a_refused_connection_goes_to_the_next_replica_once() -> None:
    async def go(urls: list[str]) -> None:
        gateway = gateway_for(urls)
        status, headers, body = await forward(gateway)
        assert (status, json.loads(body)) == (200, {"ok": "y"})
        assert (headers[REPLICA_HEADER], headers[REASON_HEADER]) == (urls[1], "retry")
        assert sample(gateway, "kvhive_gateway_retries_total", {"reason": "connect"}) == 1
        assert [r.healthy for r in gateway.replicas.replicas] == [False, True]   # marked down at once
        assert [r.inflight for r in gateway.replicas.replicas] == [0, 0]

    served(None, answers(OK))(go)


def test_a_connection_reset_before_any_answer_byte_goes_to_the_next_replica() -> None:
    async def go(urls: list[str]) -> None:
        gateway = gateway_for(urls)
        status, headers, _ = await forward(gateway)
        assert (status, headers[REPLICA_HEADER]) == (200, urls[1])
        assert sample(gateway, "kvhive_gateway_retries_total", {"reason": "reset"}) == 1
        assert gateway.replicas.replicas[0].healthy        # health checks decide about that one

    served(answers(), answers(OK))(go)


def test_only_one_retry_and_no_retry_once_an_answer_began_or_is_slow() -> None:
    async def twice_unanswered(urls: list[str]) -> None:
        gateway = gateway_for(urls)
        status, _, body = await forward(gateway)
        assert status == 503 and json.loads(body)["error"]["code"] == "no_replica"
        assert sample(gateway, "kvhive_gateway_retries_total", {"reason": "connect"}) == 1
        assert sample(gateway, "kvhive_gateway_responses_total", {"replica": urls[2], "status": "200"}) == 0

    served(None, None, answers(OK))(twice_unanswered)

    async def not_retried(urls: list[str]) -> None:
        gateway = gateway_for(urls, request_timeout_s=0.3)
        # First a half status line (502), then a replica too slow (504).
        for expected in ((502, "bad_gateway"), (504, "gateway_timeout")):
            status, headers, body = await forward(gateway)
            assert (status, json.loads(body)["error"]["code"]) == expected
            gateway.replicas.replicas.append(gateway.replicas.replicas.pop(0))
        assert sample(gateway, "kvhive_gateway_retries_total", {"reason": "reset"}) == 0
        assert sample(gateway, "kvhive_gateway_responses_total", {"replica": urls[2], "status": "200"}) == 0

    served(answers(b"HTTP/1.1 200 OK\r\n"), hangs, answers(OK))(not_retried)


def test_a_stream_cut_mid_way_ends_with_openais_error_event() -> None:
    events = [b'data: {"choices": [{"text": "a"}]}\n\n', b'data: {"choices": [{"text": "b"}]}\n\n']

    async def go(urls: list[str]) -> None:
        gateway = gateway_for(urls[:1])
        status, _, body = await forward(gateway)
        assert status == 200
        lines = [line for line in body.decode().split("\n\n") if line]
        assert lines[:2] == [e.decode().strip() for e in events]
        error = json.loads(lines[2].removeprefix("data: "))["error"]
        assert error["type"] == "server_error" and error["code"] == "bad_gateway"
        assert urls[0] in error["message"] and lines[3:] == ["data: [DONE]"]
        assert sample(gateway, "kvhive_gateway_stream_errors_total", {"replica": urls[0]}) == 1
        assert gateway.replicas.replicas[0].inflight == 0

    served(answers(SSE_HEAD, *(chunk(e) for e in events), b"5\r\nda"))(go)


def test_a_cut_responses_stream_ends_with_an_error_event_numbered_after_the_last() -> None:
    created = b'event: response.created\ndata: {"type": "response.created", "sequence_number": 0}\n\n'
    delta = b'event: response.output_text.delta\ndata: {"type": "x", "sequence_number": 1}\n\n'

    async def go(urls: list[str]) -> None:
        gateway = gateway_for(urls[:1])
        status, _, body = await forward(gateway, path="/v1/responses")
        assert status == 200 and body.startswith(created + delta)
        tail = body[len(created + delta):].decode()
        assert tail.startswith("event: error\ndata: ") and tail.endswith("\n\n")
        error = json.loads(tail.split("data: ", 1)[1])
        assert (error["type"], error["code"], error["sequence_number"]) == ("error", "bad_gateway", 2)

    served(answers(SSE_HEAD, chunk(created), chunk(delta)))(go)


def test_cut_stream_events_close_a_partial_event_first() -> None:
    ending = cut_stream_events("/v1/chat/completions", "gone", b'data: {"choi')
    assert ending.startswith(b"\n\ndata: ") and ending.endswith(b"data: [DONE]\n\n")
    assert cut_stream_events("/v1/completions", "gone", b"data: {}\n\n").startswith(b"data: {")


def test_a_cut_answer_that_is_not_sse_stays_cut_and_a_cut_json_body_is_a_502() -> None:
    chunked = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"

    async def go(urls: list[str]) -> None:
        with pytest.raises(UpstreamError):
            await forward(gateway_for(urls[:1]))
        gateway = gateway_for(urls[1:])
        status, headers, body = await forward(gateway)
        assert status == 502 and json.loads(body)["error"]["code"] == "bad_gateway"
        assert headers[REPLICA_HEADER] == urls[1]

    served(answers(chunked, chunk(b'{"a"')),
           answers(b"HTTP/1.1 200 OK\r\ncontent-length: 50\r\n\r\n{\"partial\""))(go)


def test_affinity_is_kept_per_owner() -> None:
    sessions = SessionAffinity(max_sessions=3)
    sessions.remember("a", "s1", "r1")
    assert sessions.get("a", "s1") == "r1" and sessions.get("b", "s1") is None
    sessions.remember("b", "s1", "r2")
    assert (sessions.get("a", "s1"), sessions.get("b", "s1")) == ("r1", "r2")
    sessions.forget("b", "s1")
    assert (sessions.get("a", "s1"), sessions.get("b", "s1")) == ("r1", None)
    for i in range(3):
        sessions.remember("b", f"t{i}", "r2")
    assert len(sessions) == 3 and sessions.get("a", "s1") is None         # one LRU bound for all


def test_another_keys_session_routes_as_an_unknown_id() -> None:
    a, b = key_owner("Bearer key-a"), key_owner("Bearer key-b")
    assert key_owner("Bearer  key-a ") == a and key_owner("") != a

    async def go(urls: list[str]) -> None:
        gateway = gateway_for(urls)
        gateway.policy = "least_load"
        gateway.sessions.remember(a, "sess-a", urls[1])

        async def first(session: str, owner: str) -> tuple[str, str]:
            ranked, reason = await gateway.choose(None, session, owner)
            return ranked[0].name, reason

        assert await first("sess-a", a) == (urls[1], "session")
        theirs = [await first("sess-a", b) for _ in range(4)]
        unknown = [await first("sess-never", b) for _ in range(4)]
        assert {reason for _, reason in theirs + unknown} == {"load"}
        assert {name for name, _ in theirs} == set(urls)       # tie-broken in turn, as unknown ids are
        # An answer to key B's request naming the id is remembered for key B only.
        await forward(gateway, session_id="sess-a", owner=b)
        assert gateway.sessions.get(b, "sess-a") == urls[0] and gateway.sessions.get(a, "sess-a") == urls[1]

    served(answers(OK), answers(OK))(go)


def test_bodies_over_the_gateway_limit_are_refused() -> None:
    async def body_of(pieces: list[bytes], declared: int | None = None) -> bytes | None:
        messages = [{"type": "http.request", "body": p, "more_body": i < len(pieces) - 1}
                    for i, p in enumerate(pieces)]

        async def receive() -> dict[str, Any]:
            return messages.pop(0)

        headers = [(b"content-length", str(declared).encode())] if declared is not None else []
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers,
                 "query_string": b""}
        return await read_body(Request(scope, receive), 10)

    async def go() -> None:
        assert await body_of([b"12345", b"67890"]) == b"1234567890"
        assert await body_of([b"12345", b"678901", b"never read"]) is None      # counted as it comes
        assert await body_of([b"1"], declared=11) is None                       # refused unread

    asyncio.run(go())
    refused = too_large(10)
    assert refused.status_code == 413 and refused.headers["connection"] == "close"
    assert json.loads(refused.body)["error"]["code"] == "request_too_large"
