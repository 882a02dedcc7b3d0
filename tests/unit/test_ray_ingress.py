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
