"""Run one ``HTTPEnvelope`` through an ASGI app in this process and stream its answer: first the
status and headers (``ResponseHead``), then the body's pieces as they are sent (an SSE stream
piece by piece). The replica answers with kvhive's own FastAPI app, untouched.

A consumer that stops reading (the client left) makes ``receive`` report a disconnect and
cancels the app's task, which aborts the request in the engine as a closed connection does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message

from kvhive.integrations.ray.envelope import HTTPEnvelope


@dataclass(frozen=True)
class ResponseHead:
    """The status and headers of an answer (header names lower-case)."""

    status: int
    headers: tuple[tuple[str, str], ...]


def _scope(envelope: HTTPEnvelope) -> dict[str, Any]:
    """The ASGI HTTP scope of ``envelope``."""
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": envelope.method, "scheme": "http", "path": envelope.path, "raw_path": envelope.path.encode(),
            "query_string": envelope.query_string, "root_path": "",
            "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in envelope.headers],
            "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80), "state": {}}


async def call_asgi(app: ASGIApp, envelope: HTTPEnvelope,
                    extra_headers: tuple[tuple[str, str], ...] = ()) -> AsyncIterator[ResponseHead | bytes]:
    """``app``'s answer to ``envelope``: a ``ResponseHead`` (with ``extra_headers`` added), then body
    pieces until the body ends."""
    sent: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_given = False

    async def receive() -> Message:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": envelope.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await sent.put(message)

    async def run() -> None:
        try:
            await app(_scope(envelope), receive, send)
        finally:
            await sent.put(None)

    task = asyncio.create_task(run())
    try:
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                headers = tuple((k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in message["headers"])
                yield ResponseHead(message["status"], headers + extra_headers)
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    break
        await task          # raises what the app raised outside its error handlers
    finally:
        gone.set()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
