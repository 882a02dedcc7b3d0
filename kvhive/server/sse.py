"""Server-sent events: the ``data: {json}`` frames, the ``[DONE]`` frame, the error event of a
stream that fails after its headers went out, and the streaming responses that carry them."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import anyio
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from kvhive.engine.request_errors import ConstraintRefused
from kvhive.server.errors import constraint_error, server_error, session_error
from kvhive.sessions.errors import SessionError

logger = logging.getLogger(__name__)

SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(payload: BaseModel | dict[str, Any], exclude: set[str] | None = None) -> str:
    """One server-sent event: ``data: {json}`` and a blank line."""
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json(exclude=exclude)}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


def sse_named_event(event_type: str, data: dict[str, Any]) -> str:
    """One server-sent event with a name: ``event: <type>``, ``data: {json}`` and a blank line."""
    return f"event: {event_type}\ndata: {json.dumps(data)}\n\n"


async def with_error_event(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Pass SSE events through; an engine error (or a session turn's record that could not be
    written) after the headers went out becomes an error event (OpenAI's error body) and ``[DONE]``."""
    async with contextlib.aclosing(events):
        try:
            async for event in events:
                yield event
        except SessionError as exc:  # its turn's record could not be written (logged where it failed)
            yield sse_event(session_error(exc).body())
            yield SSE_DONE
        except ConstraintRefused as exc:  # the client's constraint: its error body is a 400's
            yield sse_event(constraint_error(exc).body())
            yield SSE_DONE
        except Exception as exc:  # noqa: BLE001 - reported to the client in the stream
            logger.exception("engine error while streaming")
            yield sse_event(server_error(f"Engine error: {type(exc).__name__}: {exc}").body())
            yield SSE_DONE


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that closes its body iterator and calls ``on_close`` however sending
    ends: done, failed or cancelled (the client gone).

    Starlette neither closes a body iterator it stopped reading (its ``finally`` then waits for
    garbage collection) nor starts one when the client is gone before the first byte (its
    ``finally`` never runs); both leave a session busy unless closed here.
    """

    def __init__(self, content: AsyncGenerator[str, None], on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Send the response; then close the body and call ``on_close``, shielded from cancellation."""
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
            self.on_close()


def sse_response(events: AsyncIterator[str], headers: dict[str, str],
                 on_close: Callable[[], None] | None = None) -> StreamingResponse:
    """The SSE response over ``events`` (errors become an error event); with ``on_close``, a
    ``ClosingStreamingResponse`` that calls it however sending ends, even if it never started."""
    body = with_error_event(events)
    headers = {**SSE_HEADERS, **headers}
    if on_close is None:
        return StreamingResponse(body, media_type="text/event-stream", headers=headers)
    return ClosingStreamingResponse(body, on_close, media_type="text/event-stream", headers=headers)
