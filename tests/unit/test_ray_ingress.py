"""``KVHiveIngress`` over a stand-in ``DeploymentHandle``: it learns session holders from answers
and names them on the next request, sends a request once more when its replica died before
answering, and relays streams and errors as the replica sent them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

pytest.importorskip("ray.serve")

from ray.exceptions import ActorDiedError  # noqa: E402

from kvhive.integrations.ray.asgi_bridge import ResponseHead  # noqa: E402
from kvhive.integrations.ray.envelope import HTTPEnvelope  # noqa: E402
from kvhive.integrations.ray.ingress import ASGIEntry, KVHiveIngress  # noqa: E402


class StandInHandle:
    """Answers each call with the next scripted answer: a list of items to stream, or an exception
    raised before the first item. Records the envelopes it was given."""

    def __init__(self, answers: list[list[Any] | Exception]) -> None:
        self.answers = answers
        self.sent: list[HTTPEnvelope] = []
        self.handle_http = self

    def options(self, **_: Any) -> StandInHandle:
        """The same handle (the ingress asks for streaming)."""
        return self

    def remote(self, envelope: HTTPEnvelope) -> AsyncIterator[Any]:
        """The next scripted answer as a stream."""
        self.sent.append(envelope)
        answer = self.answers.pop(0)

        async def stream() -> AsyncIterator[Any]:
            if isinstance(answer, Exception):
                raise answer
            for item in answer:
                yield item

        return stream()


def head(status: int = 200, **headers: str) -> ResponseHead:
    """A replica's response head."""
    return ResponseHead(status, tuple((k.replace("_", "-"), v) for k, v in headers.items()))


def call(handle: StandInHandle, *requests: dict[str, Any]) -> list[httpx.Response]:
    """Send ``requests`` (httpx.request keyword arguments) to an ingress over ``handle``."""
    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=ASGIEntry(KVHiveIngress(handle)))
        async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as client:
            return [await client.request(**r) for r in requests]

    return asyncio.run(run())


def test_the_holder_learned_from_an_answer_goes_with_the_next_request() -> None:
    handle = StandInHandle([[head(x_session_id="s1", x_kvhive_replica="r2"), b"{}"],
                            [head(x_kvhive_replica="r2"), b"{}"],
                            [head(x_kvhive_replica="r1"), b"{}"]])
    call(handle, {"method": "POST", "url": "/v1/context", "json": {"prompt": "a"}},
         {"method": "POST", "url": "/v1/completions", "json": {"prompt": "b"}, "headers": {"x-session-id": "s1"}},
         {"method": "POST", "url": "/v1/completions", "json": {"prompt": "c"}, "headers": {"x-session-id": "s2"}})
    assert [e.holder for e in handle.sent] == [None, "r2", None]


def test_a_request_whose_replica_died_unanswered_is_sent_once_more() -> None:
    handle = StandInHandle([ActorDiedError(), [head(content_type="application/json"), b'{"ok": true}']])
    (answer,) = call(handle, {"method": "POST", "url": "/v1/completions", "json": {"prompt": "a"}})
    assert answer.status_code == 200 and answer.json() == {"ok": True}
    assert len(handle.sent) == 2


def test_two_dead_replicas_answer_503_in_openai_shape() -> None:
    handle = StandInHandle([ActorDiedError(), ActorDiedError()])
    (answer,) = call(handle, {"method": "POST", "url": "/v1/completions", "json": {"prompt": "a"}})
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "no_replica"


def test_a_stream_cut_after_its_head_ends_with_an_error_event() -> None:
    async def cut() -> AsyncIterator[Any]:
        yield head(content_type="text/event-stream")
        yield b"data: {}\n\n"
        raise ActorDiedError()

    handle = StandInHandle([])
    handle.remote = lambda envelope: cut()   # type: ignore[method-assign]
    (answer,) = call(handle, {"method": "POST", "url": "/v1/chat/completions", "json": {"stream": True}})
    assert answer.status_code == 200
    assert answer.text.startswith("data: {}\n\n") and '"code": "replica_failed"' in answer.text


def test_a_body_over_the_limit_is_refused_before_forwarding() -> None:
    handle = StandInHandle([])

    async def run() -> httpx.Response:
        ingress = KVHiveIngress(handle, max_request_bytes=10)
        transport = httpx.ASGITransport(app=ASGIEntry(ingress))
        async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as client:
            return await client.post("/v1/completions", content=b"x" * 11)

    answer = asyncio.run(run())
    assert answer.status_code == 413 and answer.json()["error"]["code"] == "request_too_large"
    assert handle.sent == []


def test_a_cache_keys_replica_is_learned_per_api_key_and_goes_with_its_next_request() -> None:
    handle = StandInHandle([[head(x_kvhive_replica="r2"), b"{}"], [head(x_kvhive_replica="r2"), b"{}"],
                            [head(x_kvhive_replica="r1"), b"{}"], [head(x_kvhive_replica="r1"), b"{}"]])
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt_cache_key": "agent-7"}
    call(handle, {"method": "POST", "url": "/v1/chat/completions", "json": body, "headers": {"authorization": "Bearer a"}},
         {"method": "POST", "url": "/v1/responses", "json": {"model": "m", "input": "x", "prompt_cache_key": "agent-7"},
          "headers": {"x-api-key": "a"}},
         {"method": "POST", "url": "/v1/chat/completions", "json": body, "headers": {"authorization": "Bearer b"}},
         {"method": "POST", "url": "/v1/chat/completions", "json": {**body, "prompt_cache_key": None}})
    assert [e.key_holder for e in handle.sent] == [None, "r2", None, None]


def test_a_cache_key_over_the_bound_is_refused_before_forwarding() -> None:
    handle = StandInHandle([])
    (chat,) = call(handle, {"method": "POST", "url": "/v1/chat/completions",
                            "json": {"model": "m", "prompt_cache_key": "k" * 10_240}})
    error = chat.json()["error"]
    assert chat.status_code == 400 and error["param"] == "prompt_cache_key" and "1024" in error["message"]
    assert handle.sent == []


def test_a_fork_goes_with_its_parents_holder_and_the_child_is_learned() -> None:
    handle = StandInHandle([[head(x_session_id="parent", x_kvhive_replica="r2"), b"{}"],
                            [head(x_session_id="child", x_kvhive_replica="r2"), b"{}"],
                            [head(x_kvhive_replica="r2"), b"{}"]])
    call(handle, {"method": "POST", "url": "/v1/context", "json": {"prompt": "a"}},
         {"method": "POST", "url": "/v1/context/parent/fork", "json": {}},
         {"method": "POST", "url": "/v1/completions", "json": {"prompt": "b"}, "headers": {"x-session-id": "child"}})
    assert [e.holder for e in handle.sent] == [None, "r2", "r2"]


def test_the_ingress_answers_messages_errors_in_anthropics_shape() -> None:
    async def cut() -> AsyncIterator[Any]:
        yield head(content_type="text/event-stream")
        yield b"event: message_start\ndata: {}\n\n"
        raise ActorDiedError()

    handle = StandInHandle([ActorDiedError(), ActorDiedError()])
    (gone,) = call(handle, {"method": "POST", "url": "/v1/messages", "json": {"model": "m"}})
    assert gone.status_code == 503 and gone.json() == {
        "type": "error", "error": {"type": "overloaded_error", "message": "No replica answered"}}
    handle.remote = lambda envelope: cut()   # type: ignore[method-assign]

    async def too_large() -> httpx.Response:
        transport = httpx.ASGITransport(app=ASGIEntry(KVHiveIngress(handle, max_request_bytes=10)))
        async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as client:
            return await client.post("/v1/messages", content=b"x" * 11)

    refused = asyncio.run(too_large())
    assert refused.status_code == 413 and refused.json()["error"]["type"] == "request_too_large"
    (streamed,) = call(handle, {"method": "POST", "url": "/v1/messages", "json": {"stream": True}})
    assert streamed.text.startswith("event: message_start\ndata: {}\n\nevent: error\ndata: ")
    assert '"type": "api_error"' in streamed.text
