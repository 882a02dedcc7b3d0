"""Bounded request bodies: 413 in OpenAI's error shape before a body over the limit is read.

A request whose ``Content-Length`` exceeds the limit is answered at once, its body unread. A body
without a length (chunked upload) is counted as it streams in, and the request fails with 413 on
the chunk that crosses the limit: no more than the limit (plus one chunk) is ever held. The 413
closes the connection (``Connection: close``): the rest of the body is never read, not even to
be discarded.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvhive.server.errors import APIError

MIB = 1 << 20
# The default limit: this many bytes per context token, and at least MIN_DEFAULT_BYTES. A token
# is ~4 characters of text; JSON escapes (``\u00e9``: 6 bytes a character) or a token-id list
# (``12345, ``: 7 bytes a token) take more, and chat bodies repeat roles and fields: 16 bytes a
# token, times a margin of 4.
DEFAULT_BYTES_PER_TOKEN = 64
MIN_DEFAULT_BYTES = MIB


def default_max_request_bytes(max_model_len: int) -> int:
    """The body limit that fits a whole context: max(1 MiB, 64 bytes x ``max_model_len``)."""
    return max(MIN_DEFAULT_BYTES, DEFAULT_BYTES_PER_TOKEN * max_model_len)


def too_large(limit: int, size: int | None = None) -> JSONResponse:
    """The 413 for a body over ``limit`` bytes (``size``: its declared length, when known); it
    closes the connection."""
    what = "The request body" if size is None else f"The request body ({size} bytes)"
    error = APIError(413, f"{what} exceeds this server's limit of {limit} bytes (--max-request-bytes)",
                     code="request_too_large")
    return JSONResponse(status_code=413, content=error.body(), headers={"Connection": "close"})


class BodyTooLarge(Exception):
    """Raised by the counting ``receive`` on the chunk that crosses the limit. Not an APIError: no
    handler inside the app answers it, so it reaches ``BodyLimitMiddleware``, which does."""


class BodyLimitMiddleware:
    """Refuses HTTP request bodies over ``max_bytes`` with 413, reading at most ``max_bytes`` of them.

    Invariant: the app behind it never receives more than ``max_bytes`` body bytes of one request.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer 413 on a declared length over the limit; else pass the request on, counting its body."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await too_large(self.max_bytes, declared)(scope, receive, send)
            return
        limit = self.max_bytes
        received = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge:
            if started:
                raise                   # a route read its body after answering: a bug, not a 413
            await too_large(limit)(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    """The request's declared body length; None when absent or not a number (the server frames it)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            if not value.isdigit():
                return None
            # Past 18 digits the length is over any limit (and int() refuses 4,300 digits and more).
            return int(value) if len(value) <= 18 else 10**18
    return None
