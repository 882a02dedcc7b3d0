"""Anthropic's error shape and headers on ``/v1/messages*`` (docs/anthropic.md).

Every error the app answers on those paths, wherever it is raised (the API key, the body's size,
its JSON, a field, the model, a session limit, a crash), leaves in Anthropic's shape
``{"type": "error", "error": {"type": ..., "message": ...}}`` with its status:
``AnthropicErrors`` rewrites the OpenAI-shaped body the rest of the app writes, so there is one
error path and one status table (``kvhive.core.anthropic_errors``, the gateway's too).
``check_anthropic_headers`` checks ``anthropic-version`` and ``anthropic-beta``.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvhive.core.anthropic_errors import as_anthropic_error
from kvhive.server.errors import APIError, bad_request

logger = logging.getLogger(__name__)

MESSAGES_PATH = "/v1/messages"

# The first API version with the Messages API. Any dated version from it on is served (the header
# may also be left out): request bodies are strict, so a field a newer version adds is refused by
# name rather than ignored, and a client upgraded to a newer SDK keeps working.
FIRST_ANTHROPIC_VERSION = "2023-06-01"
_VERSION_SHAPE = re.compile(r"\d{4}-\d{2}-\d{2}")
# ``anthropic-beta`` names that change nothing kvhive serves, with why; any other name is a 400.
NO_OP_BETAS: Mapping[str, str] = {
    "prompt-caching-2024-07-31": "cache_control is always on",
    "extended-cache-ttl-2025-04-11": "the 1h TTL is always on",
    "token-counting-2024-11-01": "count_tokens is always on",
    "fine-grained-tool-streaming-2025-05-14": "tool input is always streamed as it is generated",
    "interleaved-thinking-2025-05-14": "it only matters with extended thinking, which is refused",
    "claude-code-20250219": "it names the client; no field it enables is served differently",
}
MAX_BETAS = 32


def check_anthropic_headers(headers: Headers) -> None:
    """400 for an ``anthropic-version`` that is not a date (YYYY-MM-DD) from FIRST_ANTHROPIC_VERSION
    on (absent is fine), an ``anthropic-beta`` name not in NO_OP_BETAS, or kvhive's session headers
    (sessions are not served here), naming the header and the value."""
    version = headers.get("anthropic-version")
    if version is not None and not _served_version(version.strip()):
        shape = "an unknown version" if _VERSION_SHAPE.fullmatch(version.strip()) else "malformed"
        raise bad_request(f"anthropic-version {version[:40]!r} is {shape}; this server accepts a date "
                          f"YYYY-MM-DD from {FIRST_ANTHROPIC_VERSION} on", param="anthropic-version")
    betas = [b.strip() for value in headers.getlist("anthropic-beta") for b in value.split(",") if b.strip()]
    if len(betas) > MAX_BETAS:
        raise bad_request(f"anthropic-beta names at most {MAX_BETAS} betas, got {len(betas)}", param="anthropic-beta")
    for beta in betas:
        if beta not in NO_OP_BETAS:
            raise bad_request(f"anthropic-beta {beta[:80]!r} is not served; accepted (they change nothing "
                              f"here): {', '.join(NO_OP_BETAS)}", param="anthropic-beta")
    for name in ("x-session-id", "x-session-ttl"):
        if name in headers:
            raise bad_request(f"{name} is not served on the Messages API: sessions run on /v1/completions, "
                              f"/v1/chat/completions and /v1/responses; here, cache a prompt with "
                              f"cache_control breakpoints", param=name)


def _served_version(version: str) -> bool:
    """Whether ``version`` is a date YYYY-MM-DD (month 01-12, day 01-31) from FIRST_ANTHROPIC_VERSION on."""
    if _VERSION_SHAPE.fullmatch(version) is None:
        return False
    month, day = int(version[5:7]), int(version[8:10])
    return 1 <= month <= 12 and 1 <= day <= 31 and version >= FIRST_ANTHROPIC_VERSION


def _anthropic_body(status: int, raw: bytes) -> bytes:
    """An OpenAI-shaped error body rewritten in Anthropic's shape: its message, followed by the
    field it names when the message does not name it already."""
    body = as_anthropic_error(status, raw)
    param = _openai_param(raw)
    message = body["error"]["message"]
    if param and param not in message:
        body["error"]["message"] = f"{message} ({param})"
    return json.dumps(body).encode()


def _openai_param(raw: bytes) -> str | None:
    """The ``error.param`` of an OpenAI-shaped error body; None when it has none."""
    try:
        error = json.loads(raw).get("error")
    except (ValueError, AttributeError):
        return None
    param = error.get("param") if isinstance(error, dict) else None
    return param if isinstance(param, str) else None


class AnthropicErrors:
    """Rewrites error responses (status >= 400) on ``/v1/messages*`` into Anthropic's shape, and
    answers a crash there with Anthropic's 500. Other paths pass through untouched.

    Invariant: a response that started (a stream's 200) is never changed.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on; hold an error response's start until its body is rewritten."""
        if scope["type"] != "http" or not scope["path"].startswith(MESSAGES_PATH):
            await self.app(scope, receive, send)
            return
        held: dict[str, Message] = {}
        chunks: list[bytes] = []
        started = False

        async def rewriting_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if message["status"] >= 400:
                    held["start"] = message
                    return
            elif message["type"] == "http.response.body" and "start" in held:
                chunks.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                await self._send_rewritten(held.pop("start"), b"".join(chunks), send)
                return
            await send(message)

        try:
            await self.app(scope, receive, rewriting_send)
        except Exception as exc:
            if started:
                raise
            logger.exception("unhandled error on %s %s", scope["method"], scope["path"], exc_info=exc)
            error = APIError(500, f"Internal server error: {type(exc).__name__}: {exc}", type="server_error")
            await self._send_rewritten({"type": "http.response.start", "status": 500, "headers": []},
                                       json.dumps(error.body()).encode(), send)

    @staticmethod
    async def _send_rewritten(start: Message, raw: bytes, send: Send) -> None:
        status = start["status"]
        body = _anthropic_body(status, raw)
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() not in (b"content-length", b"content-type")]
        headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({**start, "headers": headers})
        await send({"type": "http.response.body", "body": body})
