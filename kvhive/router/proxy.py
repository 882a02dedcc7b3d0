"""Forwarding a request to a replica and its answer back: streamed chunk by chunk, errors OpenAI-shaped."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from kvhive.router.upstream import UpstreamClient, UpstreamError, UpstreamResponse

# Headers that describe one connection, not the message: never forwarded either way.
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                         "trailer", "trailers", "transfer-encoding", "upgrade", "host"})
_HOP_BY_HOP_RAW = frozenset(name.encode() for name in _HOP_BY_HOP)
# A forwarded request's own: the upstream client frames the body it sends.
_NOT_FORWARDED = _HOP_BY_HOP_RAW | {b"content-length"}


def openai_error(status: int, message: str, code: str | None = None,
                 headers: Mapping[str, str] | None = None, param: str | None = None) -> JSONResponse:
    """An OpenAI-shaped error answered by the gateway itself."""
    error_type = "server_error" if status >= 500 else "invalid_request_error"
    body = {"error": {"message": message, "type": error_type, "param": param, "code": code}}
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


async def open_upstream(client: UpstreamClient, base_url: str, request: Request, body: bytes,
                        path: str | None = None) -> UpstreamResponse:
    """Send ``request`` (with ``body``) to the replica at ``base_url``; the answer is left unread."""
    scope = request.scope
    query = scope.get("query_string") or b""
    url = base_url + (path or scope["path"]) + (f"?{query.decode('latin-1')}" if query else "")
    headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _NOT_FORWARDED]
    return await client.send(scope["method"], url, headers, body)


async def relay(upstream: UpstreamResponse, headers: Mapping[str, str],
                on_done: Callable[[], None], source: str = "the replica",
                on_cut: Callable[[], None] | None = None) -> Response:
    """The replica's answer as the gateway's: the body passed through as it arrives, an error
    re-shaped as OpenAI's. ``on_done`` runs once, when the upstream answer is closed; ``on_cut``
    when the replica cut a streamed answer (``source`` names it in the error the client gets)."""
    if upstream.status_code >= 400:
        try:
            raw = await upstream.read()
        except UpstreamError:
            raw = b""
        finally:
            upstream.close()
            on_done()
        return JSONResponse(status_code=upstream.status_code,
                            content=as_openai_error(upstream.status_code, raw), headers=dict(headers))
    return RelayResponse(upstream, headers, on_done, source, on_cut)


def cut_stream_events(path: str, message: str, last_chunk: bytes) -> bytes:
    """What ends an SSE stream the replica cut: OpenAI's error event for ``path``.

    Completions and chat: ``data: {"error": {...}}`` then ``data: [DONE]``, as a replica ends a
    stream its engine failed. /v1/responses: an ``error`` event (type, code, message, param,
    sequence_number one past the last one in ``last_chunk``). A partial event in ``last_chunk`` is
    closed first, so the error event parses on its own."""
    lead = b"" if not last_chunk or last_chunk.endswith(b"\n\n") else b"\n\n"
    if path.rstrip("/") == "/v1/responses":
        numbers = _SEQUENCE_NUMBER.findall(last_chunk)
        data = {"type": "error", "code": "bad_gateway", "message": message, "param": None,
                "sequence_number": int(numbers[-1]) + 1 if numbers else 0}
        return lead + b"event: error\ndata: " + json.dumps(data).encode() + b"\n\n"
    error = {"error": {"message": message, "type": "server_error", "param": None, "code": "bad_gateway"}}
    return lead + b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n"


_SEQUENCE_NUMBER = re.compile(rb'"sequence_number":\s*(\d+)')


class RelayResponse(Response):
    """Streams an upstream answer to the client, each piece as one ASGI body message.

    While a streamed answer (chunked or read to close) streams, a task waits for the client to
    leave; if it does, the upstream connection is closed at once, so the replica stops generating
    (uvicorn's h11 server only reports a departed client through ``receive``). An answer with a
    Content-Length was generated in full before it began: it is passed on in one body message (a
    502 in OpenAI's shape when it cannot be read). A server-sent event stream the replica cuts
    mid-way ends with OpenAI's error event (``cut_stream_events``) and a proper end of body; any
    other streamed answer it cuts is cut for the client too."""

    def __init__(self, upstream: UpstreamResponse, headers: Mapping[str, str],
                 on_done: Callable[[], None], source: str = "the replica",
                 on_cut: Callable[[], None] | None = None) -> None:
        self.status_code = upstream.status_code
        self.background = None
        self.raw_headers = [(k, v) for k, v in upstream.headers if k.lower() not in _HOP_BY_HOP_RAW]
        self.raw_headers += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        self._upstream = upstream
        self._on_done = on_done
        self._source = source
        self._on_cut = on_cut
        self._headers = dict(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Send the status, headers and body pieces; close the upstream answer in every case."""
        if self._upstream.streamed:
            await self._send_streamed(scope, receive, send)
        else:
            await self._send_whole(scope, receive, send)

    async def _send_whole(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Read the answer (it has a Content-Length) and send it in one body message; a 502 in
        OpenAI's shape when it cannot be read."""
        upstream = self._upstream
        try:
            try:
                body = await upstream.read()
            except UpstreamError as exc:
                if self._on_cut is not None:
                    self._on_cut()
                failed = openai_error(502, f"replica {self._source} failed: {exc}", code="bad_gateway",
                                      headers=self._headers)
                await failed(scope, receive, send)
                return
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})
        finally:
            upstream.close()
            self._on_done()

    async def _send_streamed(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Send each piece as it arrives while a task waits for the client to leave (which closes
        the upstream answer); a cut SSE stream ends with OpenAI's error event, any other is cut."""
        upstream = self._upstream
        finished = False

        def client_left(_: asyncio.Future[None]) -> None:
            if not finished:
                upstream.close()        # aborts the read in progress below

        watcher = asyncio.ensure_future(_until_disconnect(receive))
        watcher.add_done_callback(client_left)
        last = b""
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            async for chunk in upstream.chunks():
                last = chunk
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            finished = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except UpstreamError as exc:
            if watcher.done():
                return                  # the client left: nobody to tell
            if self._on_cut is not None:
                self._on_cut()
            content_type = upstream.header(b"content-type") or b""
            if not content_type.startswith(b"text/event-stream"):
                raise                   # not SSE: the client sees a broken answer
            message = f"replica {self._source} stopped mid-stream: {exc}"
            finished = True
            await send({"type": "http.response.body", "more_body": False,
                        "body": cut_stream_events(scope["path"], message, last)})
        finally:
            finished = True
            watcher.cancel()
            upstream.close()
            self._on_done()


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
