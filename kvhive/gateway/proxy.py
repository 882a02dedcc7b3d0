"""Forwarding a request to a replica and its answer back: streamed chunk by chunk, errors in the
path's dialect (OpenAI's, or Anthropic's on /v1/messages: ``kvhive.routing.dialects``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Mapping

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from kvhive.gateway.upstream import (
    UpstreamClient,
    UpstreamError,
    UpstreamMalformed,
    UpstreamResponse,
    UpstreamTimeout,
)
from kvhive.routing.dialects import as_error_body, cut_stream_events, gateway_error

# Headers that describe one connection, not the message: never forwarded either way.
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                         "trailer", "trailers", "transfer-encoding", "upgrade", "host"})
_HOP_BY_HOP_RAW = frozenset(name.encode() for name in _HOP_BY_HOP)
# A forwarded request's own: the upstream client frames the body it sends.
_NOT_FORWARDED = _HOP_BY_HOP_RAW | {b"content-length"}
# The generation routes: their 2xx answers are JSON or server-sent events.
GENERATION_PATHS = frozenset(("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"))


async def open_upstream(client: UpstreamClient, base_url: str, request: Request, body: bytes,
                        path: str | None = None) -> UpstreamResponse:
    """Send ``request`` (with ``body``) to the replica at ``base_url``; the answer is left unread."""
    scope = request.scope
    query = scope.get("query_string") or b""
    url = base_url + (path or scope["path"]) + (f"?{query.decode('latin-1')}" if query else "")
    headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _NOT_FORWARDED]
    return await client.send(scope["method"], url, headers, body)


def failure_status(status: int) -> bool:
    """Whether a replica's answer of ``status`` counts as a failure of the replica: 5xx but 501
    (a route the replica does not implement says nothing of its health)."""
    return status >= 500 and status != 501


def answer_problem(path: str, upstream: UpstreamResponse, body: bytes | None) -> str | None:
    """What is wrong with a 2xx answer to a request for ``path``, or None: an answer to a
    completion, chat or responses request is JSON or server-sent events, and a JSON body read whole
    (``body``) parses."""
    if not 200 <= upstream.status_code < 300 or upstream.status_code == 204:
        return None
    content_type = (upstream.header(b"content-type") or b"").split(b";", 1)[0].strip().lower()
    if path in GENERATION_PATHS and content_type not in (b"application/json", b"text/event-stream"):
        return f"the replica answered {content_type.decode('latin-1') or 'no content type'!r}"
    if body is not None and content_type == b"application/json":
        try:
            json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return f"the replica's JSON answer does not parse: {body[:60]!r}"
    return None


def whole_answer(upstream: UpstreamResponse, body: bytes, headers: Mapping[str, str],
                 path: str = "/v1/completions") -> Response:
    """A replica's answer read whole as the gateway's: an error re-shaped in ``path``'s dialect."""
    if upstream.status_code >= 400:
        return JSONResponse(status_code=upstream.status_code,
                            content=as_error_body(path, upstream.status_code, body), headers=dict(headers))
    response = Response(content=body, status_code=upstream.status_code)
    # The answer's own Content-Length stays: ``body`` is the whole of it.
    response.raw_headers = [(k, v) for k, v in upstream.headers if k.lower() not in _HOP_BY_HOP_RAW]
    response.raw_headers += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    return response


def failed_answer(source: str, failure: UpstreamError, headers: Mapping[str, str],
                  path: str = "/v1/completions") -> Response:
    """The gateway's answer to a request for ``path`` when ``source``'s answer failed before any
    byte reached the client: 504 when it came too late, else 502."""
    if isinstance(failure, UpstreamTimeout):
        return gateway_error(path, 504, f"replica {source} timed out: {failure}", code="gateway_timeout",
                             headers=headers)
    return gateway_error(path, 502, f"replica {source} failed: {type(failure).__name__}: {failure}",
                         code="bad_gateway", headers=headers)


class RelayResponse(Response):
    """Streams an upstream answer of unknown length (chunked or read to close) to the client, each
    piece as one ASGI body message.

    The status and headers go out with the first piece, so an answer that fails before it (too
    late, cut, or a server-sent event stream that does not begin as one) is the gateway's 502 or
    504 instead. While it streams, a task waits for the client to leave; if it does, the upstream
    connection is closed at once, so the replica stops generating (uvicorn's h11 server only
    reports a departed client through ``receive``). A server-sent event stream the replica cuts
    mid-way ends with OpenAI's error event (``cut_stream_events``) and a proper end of body; any
    other streamed answer it cuts is cut for the client too. ``on_done`` runs once, with None when
    the answer was relayed in full or the client left, else the failure's kind."""

    def __init__(self, upstream: UpstreamResponse, headers: Mapping[str, str],
                 on_done: Callable[[str | None], None], source: str = "the replica") -> None:
        self.status_code = upstream.status_code
        self.background = None
        self.raw_headers = [(k, v) for k, v in upstream.headers if k.lower() not in _HOP_BY_HOP_RAW]
        self.raw_headers += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        self._upstream = upstream
        self._on_done = on_done
        self._source = source
        self._headers = dict(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Send the status, headers and body pieces; close the upstream answer in every case."""
        upstream = self._upstream
        finished = False
        failure: str | None = None

        def client_left(_: asyncio.Future[None]) -> None:
            if not finished:
                upstream.close()        # aborts the read in progress below

        watcher = asyncio.ensure_future(_until_disconnect(receive))
        watcher.add_done_callback(client_left)
        sse = (upstream.header(b"content-type") or b"").startswith(b"text/event-stream")
        started = False
        last = b""
        try:
            async with contextlib.aclosing(upstream.chunks()) as pieces:
                async for chunk in pieces:
                    if not started:
                        if sse and not chunk.lstrip(b"\r\n").startswith(_SSE_FIELDS):
                            raise UpstreamMalformed(f"the event stream began with {chunk[:60]!r}")
                        started = True
                        await send({"type": "http.response.start", "status": self.status_code,
                                    "headers": self.raw_headers})
                    last = chunk
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            finished = True
            if not started:
                await send({"type": "http.response.start", "status": self.status_code,
                            "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except UpstreamError as exc:
            if watcher.done():
                return                  # the client left: nobody to tell
            failure = exc.kind
            finished = True
            if not started:
                await failed_answer(self._source, exc, self._headers, scope["path"])(scope, receive, send)
                return
            if not sse:
                raise                   # not SSE: the client sees a broken answer
            message = f"replica {self._source} stopped mid-stream: {exc}"
            await send({"type": "http.response.body", "more_body": False,
                        "body": cut_stream_events(scope["path"], message, last)})
        finally:
            finished = True
            watcher.cancel()
            upstream.close()
            self._on_done(failure)


# How a server-sent event stream's first line begins (a field name, or ":" for a comment).
_SSE_FIELDS = (b"data:", b"event:", b"id:", b"retry:", b":")


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
