"""The API dialect of a routed path: Anthropic's on ``/v1/messages`` and below it
(``count_tokens``), OpenAI's everywhere else. It decides the shape of the errors a front door (the
gateway, Ray's ingress) answers itself, of the event that ends a stream a replica cut, and how a
replica's error body is re-shaped (Anthropic's shape itself: ``kvhive.core.anthropic_errors``);
``x-api-key`` carries the key of Anthropic's clients.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from starlette.responses import JSONResponse

from kvhive.core.anthropic_errors import anthropic_error_body, as_anthropic_error
from kvhive.core.query_params import strict_query_route

MESSAGES_PATH = "/v1/messages"
# The Messages routes the gateway routes like chat (by the prompt's KV score).
ANTHROPIC_PATHS = frozenset((MESSAGES_PATH, "/v1/messages/count_tokens"))
# The header Anthropic's clients send their key in.
API_KEY_HEADER = "x-api-key"


def is_anthropic(path: str) -> bool:
    """Whether ``path`` speaks Anthropic's Messages API: /v1/messages and every path below it."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def openai_error(status: int, message: str, code: str | None = None,
                 headers: Mapping[str, str] | None = None, param: str | None = None) -> JSONResponse:
    """An OpenAI-shaped error answered by the gateway itself."""
    error_type = "server_error" if status >= 500 else "invalid_request_error"
    body = {"error": {"message": message, "type": error_type, "param": param, "code": code}}
    return JSONResponse(status_code=status, content=body, headers=dict(headers or {}))


# The route class of the routes the gateway answers itself: a query parameter the route does not
# take is a 400 in OpenAI's shape naming it (``kvhive.core.query_params``).
GATEWAY_ROUTE = strict_query_route(lambda message, param: openai_error(400, message, param=param))


def gateway_error(path: str, status: int, message: str, code: str | None = None,
                  headers: Mapping[str, str] | None = None, param: str | None = None) -> JSONResponse:
    """An error answered by the gateway itself to a request for ``path``: Anthropic's shape on
    /v1/messages, else OpenAI's (``openai_error``)."""
    if is_anthropic(path):
        return JSONResponse(status_code=status, content=anthropic_error_body(status, message),
                            headers=dict(headers or {}))
    return openai_error(status, message, code, headers, param)


def as_error_body(path: str, status: int, raw: bytes) -> dict[str, Any]:
    """A replica's error body for ``path`` in the path's dialect."""
    return as_anthropic_error(status, raw) if is_anthropic(path) else as_openai_error(status, raw)


def as_openai_error(status: int, raw: bytes) -> dict[str, Any]:
    """A replica's error body in OpenAI's shape: kept when it already is, else wrapped (vLLM's older
    flat ``{"message", "type", "code"}``, FastAPI's ``{"detail"}``, plain text)."""
    try:
        data = json.loads(raw) if raw else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        data = None
    default_type = "server_error" if status >= 500 else "invalid_request_error"
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return data
    if isinstance(data, dict) and ("message" in data or "detail" in data):
        message = data.get("message", data.get("detail"))
        return {"error": {"message": message if isinstance(message, str) else json.dumps(message),
                          "type": data.get("type") if isinstance(data.get("type"), str) else default_type,
                          "param": data.get("param"), "code": data.get("code")}}
    text = raw.decode("utf-8", "replace").strip() if raw else ""
    return {"error": {"message": text or f"replica answered HTTP {status}", "type": default_type,
                      "param": None, "code": None}}


def cut_stream_events(path: str, message: str, last_chunk: bytes) -> bytes:
    """What ends an SSE stream the replica cut: the API's error event for ``path``.

    Completions and chat: ``data: {"error": {...}}`` then ``data: [DONE]``, as a replica ends a
    stream its engine failed. /v1/responses: an ``error`` event (type, code, message, param,
    sequence_number one past the last one in ``last_chunk``). /v1/messages: Anthropic's ``error``
    event. A partial event in ``last_chunk`` is closed first, so the error event parses on its own."""
    lead = b"" if not last_chunk or last_chunk.endswith(b"\n\n") else b"\n\n"
    if is_anthropic(path):
        return lead + b"event: error\ndata: " + json.dumps(anthropic_error_body(502, message)).encode() + b"\n\n"
    if path.rstrip("/") == "/v1/responses":
        numbers = _SEQUENCE_NUMBER.findall(last_chunk)
        data = {"type": "error", "code": "bad_gateway", "message": message, "param": None,
                "sequence_number": int(numbers[-1]) + 1 if numbers else 0}
        return lead + b"event: error\ndata: " + json.dumps(data).encode() + b"\n\n"
    error = {"error": {"message": message, "type": "server_error", "param": None, "code": "bad_gateway"}}
    return lead + b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n"


_SEQUENCE_NUMBER = re.compile(rb'"sequence_number":\s*(\d+)')
