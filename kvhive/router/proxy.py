"""Forwarding a request to a replica and its answer back: streamed chunk by chunk, errors OpenAI-shaped."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

# Headers that describe one connection, not the message: never forwarded either way.
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                         "trailer", "trailers", "transfer-encoding", "upgrade", "host"})


def openai_error(status: int, message: str, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> JSONResponse:
    """An OpenAI-shaped error answered by the gateway itself."""
    error_type = "server_error" if status >= 500 else "invalid_request_error"
    body = {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    return JSONResponse(status_code=status, content=body, headers=dict(headers or {}))


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


async def open_upstream(client: httpx.AsyncClient, base_url: str, request: Request, body: bytes,
                        path: str | None = None) -> httpx.Response:
    """Send ``request`` (with ``body``) to the replica at ``base_url``; the answer is left unread."""
    headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP
               and k.lower() != "content-length"]
    upstream = client.build_request(request.method, base_url + (path or request.url.path),
                                    params=request.url.query or None, headers=headers,
                                    content=body if body else None)
    return await client.send(upstream, stream=True)


async def relay(upstream: httpx.Response, headers: Mapping[str, str],
                on_done: Callable[[], None]) -> Response:
    """The replica's answer as the gateway's: the body streamed through as it arrives, an error
    re-shaped as OpenAI's. ``on_done`` runs once, when the upstream response is closed."""
    done = False

    async def finish() -> None:
        nonlocal done
        if not done:
            done = True
            await upstream.aclose()
            on_done()

    if upstream.status_code >= 400:
        try:
            raw = await upstream.aread()
        finally:
            await finish()
        return JSONResponse(status_code=upstream.status_code,
                            content=as_openai_error(upstream.status_code, raw), headers=dict(headers))

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        finally:
            await finish()

    response = StreamingResponse(body(), status_code=upstream.status_code, background=BackgroundTask(finish))
    response.raw_headers = [
        (k.encode("latin-1"), v.encode("latin-1"))
        for k, v in [*upstream.headers.multi_items(), *headers.items()]
        if k.lower() not in _HOP_BY_HOP
    ]
    return response
