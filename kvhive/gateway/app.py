"""``kvhive gateway``: the OpenAI-compatible proxy app in front of the replicas: its routes, one
method each of ``GatewayRoutes``, and the fast path of the routed POSTs."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from kvhive.core.cors import CorsConfig, install_cors
from kvhive.core.dashboard_data import OPEN_DASHBOARD, DashboardAccess
from kvhive.core.json_body import BodyError, MalformedJSON, load_json, off_loop_for
from kvhive.core.tenancy import key_owner
from kvhive.core.tokenizer import Tokenizer
from kvhive.gateway.dashboard_gateway import GatewayDashboard, install_gateway_dashboard
from kvhive.gateway.gateway_config import GatewayConfig
from kvhive.gateway.pd import route_disaggregated, wants_prefill
from kvhive.gateway.replicas import Replica
from kvhive.gateway.tokenize_api import TokenizeAPI
from kvhive.gateway.wiring import GatewayParts, build_gateway
from kvhive.routing.affinity import SESSION_HEADER, cache_key_problem
from kvhive.routing.dialects import (
    ANTHROPIC_PATHS,
    API_KEY_HEADER,
    GATEWAY_ROUTE,
    as_openai_error,
    gateway_error,
    openai_error,
)
from kvhive.routing.index import KVBlockIndex
from kvhive.routing.prompts import Prompt, prompt_for_path

logger = logging.getLogger(__name__)

_ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", *sorted(ANTHROPIC_PATHS))


def create_gateway_app(config: GatewayConfig, tokenizer: Tokenizer,
                       index: KVBlockIndex | None = None, cors: CorsConfig | None = None,
                       dashboard: DashboardAccess = OPEN_DASHBOARD) -> FastAPI:
    """The gateway app; replicas are checked and event subscribers started when it starts.
    ``cors``: the browser origins allowed (None: no CORS headers). ``dashboard``: whether the live
    page is served and who reads its data (``kvhive.gateway.dashboard_gateway``)."""
    parts = build_gateway(config, tokenizer, index)
    app = FastAPI(title="kvhive gateway", version="0.1.0", lifespan=parts.lifespan)
    app.state.gateway = parts.gateway
    app.state.index = parts.index
    if dashboard.enabled:
        install_gateway_dashboard(app, GatewayDashboard(parts.replicas, parts.metrics, dashboard))
    GatewayRoutes(config, parts).install(app)
    install_cors(app, cors)               # added last, so a preflight is answered before any route
    return app


class GatewayRoutes:
    """The gateway's HTTP routes, one method each, over the wired parts."""

    def __init__(self, config: GatewayConfig, parts: GatewayParts) -> None:
        self.config = config
        self.gateway = parts.gateway
        self.replicas = parts.replicas
        self.replica_set = parts.replica_set
        self.metrics = parts.metrics
        self.tokenizing = TokenizeAPI(parts.prompts.tokenizer, self.list_models, parts.prompts.run)

    def install(self, app: FastAPI) -> None:
        """Add the routes, the handler of the gateway's own errors and the routed POSTs' fast path
        to ``app``; the catch-all ``/v1/{rest}`` comes last."""
        app.add_exception_handler(Exception, answer_crash)
        # The routes the gateway answers itself refuse query parameters by name; the others pass
        # theirs on to the replica, which does.
        for path, handler, method in (("/health", self.health, "GET"), ("/metrics", self.prometheus_metrics, "GET"),
                                      ("/v1/models", self.list_models, "GET"),
                                      ("/v1/models/{model_id:path}", self.retrieve_model, "GET"),
                                      ("/tokenize", self.tokenize, "POST"), ("/detokenize", self.tokenize, "POST")):
            app.router.add_api_route(path, handler, methods=[method], response_model=None, route_class_override=GATEWAY_ROUTE)
        app.add_api_route("/reset_prefix_cache", self.reset_prefix_cache, methods=["POST"], response_model=None)
        # vLLM's /tokenizer_info: every replica serves one model, so any replica's answer is the gateway's.
        app.add_api_route("/tokenizer_info", self.routed, methods=["GET"], response_model=None)
        for path in _ROUTED_PATHS:
            app.router.add_route(path, self.routed, methods=["POST"], include_in_schema=False)
        # The hot path: these POSTs skip the router and the middleware below this one.
        app.add_middleware(RoutedFastPath, paths=frozenset(_ROUTED_PATHS), handler=self.routed_asgi)
        app.add_api_route("/v1/context", self.contexts, methods=["GET", "POST"], response_model=None)
        app.add_api_route("/v1/context/{session_id}", self.context, methods=["GET", "PATCH", "DELETE"],
                          response_model=None)
        app.add_api_route("/v1/context/{session_id}/fork", self.fork_context, methods=["POST"],
                          response_model=None)
        app.add_api_route("/v1/responses/{response_id}", self.stored_response, methods=["GET", "DELETE"],
                          response_model=None)
        app.add_api_route("/v1/responses/{response_id}/input_items", self.stored_input_items,
                          methods=["GET"], response_model=None)
        app.add_api_route("/v1/{rest:path}", self.other, methods=["GET", "POST", "PUT", "PATCH", "DELETE"],
                          response_model=None)

    async def health(self) -> JSONResponse:
        """200 while at least one replica is healthy, else 503; lists each replica's health check
        state ("replicas": up or down) and its details ("details": ``Replica.describe``: ejection,
        events endpoint)."""
        states = {r.name: "up" if r.healthy else "down" for r in self.replicas}
        now, wall = time.monotonic(), time.time()
        details = {r.name: r.describe(now, wall) for r in self.replicas}
        ok = any(r.healthy for r in self.replicas)
        return JSONResponse(status_code=200 if ok else 503,
                            content={"status": "ok" if ok else "no healthy replica", "replicas": states,
                                     "details": details})

    async def prometheus_metrics(self) -> Response:
        """Routing decisions, index lookup latency, replica and event-stream state."""
        payload, content_type = self.metrics.render()
        return Response(content=payload, media_type=content_type)

    async def list_models(self, request: Request) -> Response:
        """The models of every healthy replica, each id once."""
        return _merge_lists(await self.gateway.fan_out(request, "/v1/models"), key="id")

    async def retrieve_model(self, request: Request, model_id: str) -> Response:
        """The card of ``model_id`` from the healthy replicas' lists (ids may hold '/'); 404 in
        OpenAI's shape when none serves it."""
        models = await self.list_models(request)
        if models.status_code != 200:
            return models               # no replica, or the caller's key refused: as the replicas say
        cards = json.loads(bytes(models.body)).get("data") or []
        card = next((c for c in cards if isinstance(c, dict) and c.get("id") == model_id), None)
        if card is None:
            served = ", ".join(f"`{c.get('id')}`" for c in cards if isinstance(c, dict))
            return openai_error(404, f"The model `{model_id}` does not exist. Served models: {served}.",
                                param="model", code="model_not_found")
        return JSONResponse(card)

    async def reset_prefix_cache(self, request: Request) -> Response:
        """``POST /reset_prefix_cache`` (vLLM's query parameters passed on) on every healthy
        replica: each one's answer by replica URL; a replica's refusal of the request (4xx) is the
        answer, and 502 names the replicas that failed or could not be reached. The replicas' KV events then
        tell this gateway's index what they dropped."""
        asked = {r.name for r in self.replica_set.healthy()}
        answers = await self.gateway.fan_out(request, "/reset_prefix_cache", method="POST", timeout_s=60.0)
        if not answers:
            return openai_error(503, "No replica could be reached", code="no_replica")
        refused = next((a for a in answers if 400 <= a[1] < 500), None)
        if refused is not None:
            raw = json.dumps(refused[2]).encode() if refused[2] is not None else b""
            return JSONResponse(status_code=refused[1], content=as_openai_error(refused[1], raw))
        failed = sorted({r.name for r, status, _ in answers if status >= 400} | (asked - {r.name for r, _, _ in answers}))
        if failed:
            return openai_error(502, f"the reset failed on {', '.join(failed)}", code="bad_gateway")
        return JSONResponse({"replicas": {r.name: body for r, _, body in answers}})

    async def tokenize(self, request: Request) -> Response:
        """/tokenize and /detokenize, answered with the gateway's own tokenizer."""
        body = await read_body(request, self.config.max_request_bytes)
        if body is None:
            return too_large(self.config.max_request_bytes)
        return await self.tokenizing.answer(request, body)

    async def routed(self, request: Request) -> Response:
        """A request for the best replica: its session's holder, else by KV score, its
        prompt_cache_key's replica and load. Errors of the gateway's own are in the path's dialect."""
        limit, path = self.config.max_request_bytes, request.scope["path"]
        body = await read_body(request, limit)
        if body is None:
            return too_large(limit, path)
        owner = request_owner(request)
        try:
            data, prompt = await off_loop_for(body, _routing_view, body,
                                              owner if self.config.salt_with_api_key else None, path)
        except BodyError as exc:
            return gateway_error(path, 400, exc.message, param=exc.param)
        cache_key = data.get("prompt_cache_key") if data is not None else None
        problem = cache_key_problem(cache_key)
        if problem is not None:
            return gateway_error(path, 400, problem, param="prompt_cache_key")
        session_id = _session_named(request, data)
        if self.config.disaggregated and wants_prefill(path, data, session_id):
            return await route_disaggregated(self.gateway, request, data, prompt, owner,
                                             self.config.request_timeout_s)
        key = cache_key if isinstance(cache_key, str) and cache_key else None
        candidates, reason = await self.gateway.choose(prompt, session_id, owner, cache_key=key)
        if not candidates:
            return gateway_error(path, 503, "No healthy replica", code="no_replica")
        return await self.gateway.forward(request, body, candidates, reason, owner, session_id=session_id,
                                          cache_key=key)

    async def routed_asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``routed`` as an ASGI app, for the fast path: an error of the gateway's own is answered
        here (the fast path skips the app's error middleware)."""
        try:
            response = await self.routed(Request(scope, receive))
        except Exception as exc:  # noqa: BLE001 - the fast path has no error middleware: answered here
            response = gateway_crash(scope, exc)
        await response(scope, receive, send)

    async def contexts(self, request: Request) -> Response:
        """POST creates a session on the best replica; GET lists the caller's sessions everywhere."""
        if request.method == "POST":
            return await self.routed(request)
        return _merge_lists(await self.gateway.fan_out(request, "/v1/context"), key="id")

    async def to_holder(self, request: Request, session_id: str) -> Response:
        """Sent to the replica holding the caller's session or stored response (asking each in turn
        when the gateway does not know it for the caller's key); a DELETE that succeeds forgets it."""
        owner = request_owner(request)
        holder = await self.gateway.sessions.aget(owner, session_id)
        healthy = self.replica_set.healthy()
        routable = self.gateway.routable(healthy)
        first = [r for r in routable if r.name == holder]
        # Ejected replicas last: one of them may still be the only one holding the id.
        ejected = [r for r in healthy if all(r is not k for k in routable)]
        candidates = first + [r for r in routable if r.name != holder] + ejected
        if not candidates:
            return openai_error(503, "No healthy replica", code="no_replica")
        body = await read_body(request, self.config.max_request_bytes)
        if body is None:
            return too_large(self.config.max_request_bytes)
        response = await self.gateway.forward(request, body, candidates, "session", owner,
                                              find_session=session_id)
        if request.method == "DELETE" and response.status_code < 400:
            await self.gateway.sessions.aforget(owner, session_id)
        return response

    async def context(self, request: Request, session_id: str) -> Response:
        """One session: on the replica that holds it."""
        return await self.to_holder(request, session_id)

    async def fork_context(self, request: Request, session_id: str) -> Response:
        """A fork of a session: on the replica holding the parent, where its blocks are; the child
        the answer names in x-session-id is remembered there, so its turns follow it."""
        return await self.to_holder(request, session_id)

    async def stored_response(self, request: Request, response_id: str) -> Response:
        """One stored response: on the replica that stored it."""
        return await self.to_holder(request, response_id)

    async def stored_input_items(self, request: Request, response_id: str) -> Response:
        """A stored response's input items: on the replica that stored it."""
        return await self.to_holder(request, response_id)

    async def other(self, request: Request, rest: str) -> Response:
        """Any other OpenAI route: session affinity, else load."""
        return await self.routed(request)


async def answer_crash(request: Request, exc: Exception) -> Response:
    """The app's handler of an exception no route caught: ``gateway_crash``."""
    return gateway_crash(request.scope, exc)


def _session_named(request: Request, data: dict[str, Any] | None) -> str | None:
    """The session a request continues: x-session-id, a chat conversation_id, or the stored
    response a /v1/responses request continues (its replica holds its conversation's KV)."""
    named = [data.get(k) for k in ("conversation_id", "previous_response_id")] if data is not None else []
    return request.headers.get(SESSION_HEADER) or next((n for n in named if isinstance(n, str)), None)


def request_owner(request: Request) -> str:
    """The owner digest of the caller's key (``Authorization: Bearer``, else ``x-api-key``)."""
    return key_owner(request.headers.get("authorization"), request.headers.get(API_KEY_HEADER))


def gateway_crash(scope: Scope, exc: Exception) -> Response:
    """An error of the gateway's own as a 500 in the path's dialect (logged), never a plain-text page."""
    logger.error("unhandled error on %s %s", scope.get("method"), scope.get("path"), exc_info=exc)
    return gateway_error(scope.get("path", ""), 500, f"Gateway error: {type(exc).__name__}: {exc}",
                         code="internal_server_error")


class RoutedFastPath:
    """ASGI middleware: POSTs to ``paths`` go straight to ``handler``, everything else to the app.
    Routing, FastAPI's exception and body-limit middleware and Request plumbing cost about as much
    as the rest of a forwarded request; the routed endpoints need none of them."""

    def __init__(self, app: ASGIApp, paths: frozenset[str],
                 handler: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app
        self.paths = paths
        self.handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Dispatch one ASGI connection."""
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self.paths:
            await self.handler(scope, receive, send)
        else:
            await self.app(scope, receive, send)


async def read_body(request: Request, limit: int) -> bytes | None:
    """The request's body, or None when it is over ``limit`` bytes (declared, or counted as it
    arrives: at most ``limit`` bytes and one piece are read)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return None
    pieces: list[bytes] = []
    size = 0
    async for piece in request.stream():
        size += len(piece)
        if size > limit:
            return None
        pieces.append(piece)
    return b"".join(pieces)


def too_large(limit: int, path: str = "/v1/completions") -> Response:
    """The 413 for a body over the gateway's limit (in ``path``'s dialect); it closes the
    connection (the rest of the body is never read)."""
    return gateway_error(path, 413, f"The request body exceeds the gateway's limit of {limit} bytes "
                                    f"(--max-request-bytes)", code="request_too_large",
                         headers={"connection": "close"})


class RoutingView(NamedTuple):
    """What routing reads from a body: the JSON object (None when it is none) and its prompt."""

    data: dict[str, Any] | None
    prompt: Prompt | None


def _routing_view(body: bytes, salt_owner: str | None, path: str) -> RoutingView:
    """The body as a JSON object (``_json_object``) and the prompt it asks for at ``path`` (salted
    by ``salt_owner``); linear in the body's size, and run off the event loop for a large body."""
    data = _json_object(body)
    return RoutingView(data, prompt_for_path(path, data, salt_owner) if data is not None else None)


def _json_object(body: bytes) -> dict[str, Any] | None:
    """The body as a JSON object; None when it is none (it is forwarded as it is, and the replica
    answers); BodyError for JSON no replica takes (nested too deep, a lone surrogate in a string)."""
    try:
        data = load_json(body) if body else None
    except MalformedJSON:
        return None
    return data if isinstance(data, dict) else None


def _merge_lists(answers: list[tuple[Replica, int, Any]], key: str) -> Response:
    """One ``{"object": "list", "data": [...]}`` from every 200 answer (items deduplicated by
    ``key``); when none succeeded, the first error as OpenAI's."""
    ok = [a for a in answers if a[1] == 200 and isinstance(a[2], dict)]
    if not ok:
        if answers:
            status = answers[0][1]
            raw = json.dumps(answers[0][2]).encode() if answers[0][2] is not None else b""
            return JSONResponse(status_code=status, content=as_openai_error(status, raw))
        return openai_error(503, "No healthy replica", code="no_replica")
    seen: dict[Any, Any] = {}
    for _, _, body in ok:
        for item in body.get("data") or []:
            ident = item.get(key) if isinstance(item, dict) else None
            seen.setdefault(ident if ident is not None else id(item), item)
    return JSONResponse({"object": "list", "data": list(seen.values())})
