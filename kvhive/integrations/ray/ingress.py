"""``KVHiveIngress``: the application's OpenAI-compatible HTTP entry. It forwards every request,
streaming included, to the kvhive replicas through a ``DeploymentHandle`` whose router is
``KVAwareRequestRouter``, and learns which replica holds which session from the answers.

Session affinity: a replica names itself in ``x-kvhive-replica``; an answer that carries
``x-session-id`` or ``x-kvhive-response-id``, or answers a request naming a session, makes that
replica its holder for the caller's key (``SessionAffinity``, shared through Redis with the other
ingress replicas when the engine has a ``redis_url``). The holder goes with the next request that
names the id, and the router puts it first while it lives. A request's ``prompt_cache_key`` is
remembered the same way (per key, in a map of its own): the replica that last answered it goes
with the next request that names it, and the router gives it ``RoutingWeights.cache_key``'s bonus
(same key, same replica while its load allows). A key longer than
``MAX_PROMPT_CACHE_KEY_CHARS`` is refused with a 400 before anything is routed. The ingress's own
errors on /v1/messages are in Anthropic's shape.

A request whose replica died before any byte of its answer came back is sent once more (the
router no longer offers the dead replica). A stream cut after its head has gone out cannot be
sent again: it ends with an SSE error event (or a short body), and the replica's death is logged.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.types import Receive, Scope, Send

from kvhive.core.json_body import off_loop_for
from kvhive.integrations.ray.asgi_bridge import ResponseHead
from kvhive.integrations.ray.envelope import REPLICA_HEADER, HTTPEnvelope
from kvhive.routing.affinity import (
    RESPONSE_ID_HEADER,
    SESSION_HEADER,
    SessionAffinity,
    SharedAffinity,
    cache_key_problem,
)
from kvhive.routing.dialects import cut_stream_events, gateway_error, is_anthropic

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 16 << 20


class ReplicaGone(Exception):
    """The replica died before answering."""


class KVHiveIngress:
    """Forwards HTTP to the kvhive replicas (see the module docstring); its ASGI app is ``asgi``."""

    def __init__(self, replicas: Any, redis_url: str | None = None, session_ttl_s: int = 86400,
                 max_request_bytes: int | None = None) -> None:
        self.replicas = replicas.options(stream=True)
        self.max_request_bytes = max_request_bytes or DEFAULT_MAX_REQUEST_BYTES
        self.affinity: SessionAffinity | SharedAffinity = SessionAffinity()
        self.cache_keys: SessionAffinity | SharedAffinity = SessionAffinity()
        if redis_url:
            from kvhive.routing.redis_link import RedisLink

            link = RedisLink(redis_url)
            self.affinity = SharedAffinity(link, session_ttl_s, self.affinity)
            self.cache_keys = SharedAffinity(link, session_ttl_s, self.cache_keys, "kvhive:cachekey:")

    def __serve_build_asgi_app__(self) -> Any:
        """The ASGI app Ray Serve's proxy calls."""
        return ASGIEntry(self)

    async def asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer one HTTP request by forwarding it (lifespan events are acknowledged)."""
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        body = await _read_body(receive, self.max_request_bytes)
        if body is None:
            await gateway_error(scope["path"], 413, f"The request body exceeds {self.max_request_bytes} bytes",
                                code="request_too_large")(scope, receive, send)
            return
        envelope = _envelope(scope, body)
        data = await off_loop_for(envelope.body, envelope.json_body)
        cache_key = data.get("prompt_cache_key") if data is not None else None
        problem = cache_key_problem(cache_key)
        if problem is not None:
            await gateway_error(scope["path"], 400, problem, param="prompt_cache_key")(scope, receive, send)
            return
        key = cache_key if isinstance(cache_key, str) and cache_key else None
        named = envelope.session_named(data)
        envelope = dataclasses.replace(
            envelope, holder=await self.affinity.aget(envelope.owner, named) if named else None,
            key_holder=await self.cache_keys.aget(envelope.owner, key) if key else None)
        await self.answer(envelope, named, scope, receive, send, key)

    async def answer(self, envelope: HTTPEnvelope, named: str | None, scope: Scope, receive: Receive,
                     send: Send, cache_key: str | None = None) -> None:
        """Forward ``envelope`` (once more if its replica died unanswered) and relay the answer."""
        for attempt in range(2):
            stream = self.replicas.handle_http.remote(envelope)
            try:
                head = await _first(stream)
            except ReplicaGone as exc:
                logger.warning("replica died before answering (%s)%s", exc, "; sending again" if not attempt else "")
                continue
            except Exception as exc:  # noqa: BLE001 - the replica's own failure, answered in OpenAI's shape
                logger.exception("replica failed")
                await gateway_error(scope["path"], 500, f"replica failed: {type(exc).__name__}: {exc}",
                                    code="internal_server_error")(scope, receive, send)
                return
            await self._learn(envelope, named, head, cache_key)
            await _relay(head, stream, send, scope["path"])
            return
        await gateway_error(scope["path"], 503, "No replica answered", code="no_replica")(scope, receive, send)

    async def _learn(self, envelope: HTTPEnvelope, named: str | None, head: ResponseHead,
                     cache_key: str | None = None) -> None:
        """Remember the answering replica as the holder of the session and response it names, and
        of the request's prompt_cache_key."""
        headers = dict(head.headers)
        replica = headers.get(REPLICA_HEADER)
        if replica is None:
            return
        owner = envelope.owner
        if envelope.method == "DELETE" and named and head.status < 400:
            await self.affinity.aforget(owner, named)
            return
        if head.status >= 400:
            return
        for key in (headers.get(SESSION_HEADER) or named, headers.get(RESPONSE_ID_HEADER)):
            if key:
                await self.affinity.aremember(owner, key, replica)
        if cache_key:
            await self.cache_keys.aremember(owner, cache_key, replica)


class ASGIEntry:
    """An ASGI 3 app (a class with ``__call__``, as servers detect it) over ``KVHiveIngress.asgi``."""

    def __init__(self, ingress: KVHiveIngress) -> None:
        self.ingress = ingress

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer one ASGI connection."""
        await self.ingress.asgi(scope, receive, send)


def _envelope(scope: Scope, body: bytes) -> HTTPEnvelope:
    """The envelope of an ASGI HTTP request."""
    headers = tuple((k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in scope["headers"])
    return HTTPEnvelope(scope["method"], scope["path"], scope.get("query_string", b""), headers, body)


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole body, or None once it passes ``limit`` bytes."""
    pieces, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        piece = message.get("body", b"")
        size += len(piece)
        if size > limit:
            return None
        pieces.append(piece)
        if not message.get("more_body", False):
            break
    return b"".join(pieces)


async def _first(stream: AsyncIterator[Any]) -> ResponseHead:
    """The head of a replica's answer; ``ReplicaGone`` when the replica died first."""
    from ray.exceptions import ActorUnavailableError, RayActorError  # ActorDiedError is a RayActorError

    try:
        head = await stream.__anext__()
    except (RayActorError, ActorUnavailableError) as exc:
        raise ReplicaGone(str(exc)[:200]) from exc
    if not isinstance(head, ResponseHead):
        raise TypeError(f"a replica answered {type(head).__name__} before its head")
    return head


async def _relay(head: ResponseHead, stream: AsyncIterator[Any], send: Send, path: str = "") -> None:
    """Send ``head``, then the body pieces as they come; a stream cut by the replica's death ends
    with an SSE error event when it is an event stream (Anthropic's on /v1/messages)."""
    await send({"type": "http.response.start", "status": head.status,
                "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in head.headers]})
    try:
        async for piece in stream:
            await send({"type": "http.response.body", "body": piece, "more_body": True})
    except Exception as exc:  # noqa: BLE001 - the head is out: the stream can only end early
        logger.warning("answer cut: the replica failed mid-stream (%s)", type(exc).__name__)
        if dict(head.headers).get("content-type", "").startswith("text/event-stream") and is_anthropic(path):
            await send({"type": "http.response.body", "more_body": True,
                        "body": cut_stream_events(path, "the replica serving this stream stopped", b"")})
        elif dict(head.headers).get("content-type", "").startswith("text/event-stream"):
            error = {"error": {"message": "the replica serving this stream stopped", "type": "server_error",
                               "param": None, "code": "replica_failed"}}
            await send({"type": "http.response.body", "body": f"data: {json.dumps(error)}\n\n".encode(),
                        "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})
