"""The FastAPI app over a replica's services: OpenAI routes, Anthropic's Messages API, health,
metrics, API keys; and ``run_server`` (uvicorn). ``kvhive.launch`` builds the services."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from kvhive.core.cors import CorsConfig, install_cors
from kvhive.core.dashboard_data import DashboardAccess
from kvhive.core.http_limits import HttpLimits
from kvhive.core.http_protocol import uvicorn_options
from kvhive.core.query_params import strict_query_route
from kvhive.server.body_limit import BodyLimitMiddleware, default_max_request_bytes
from kvhive.server.chat import create_chat_completion
from kvhive.server.chat_protocol import ChatCompletionRequest, ChatCompletionResponse
from kvhive.server.completions import create_completion
from kvhive.server.context import install_context_routes, session_sweeper
from kvhive.server.dashboard_replica import ReplicaDashboard, dashboard_sampler, install_dashboard
from kvhive.server.errors import APIError, bad_request, install_error_handlers
from kvhive.server.generation import GenerationService
from kvhive.server.messages import install_messages_routes
from kvhive.server.messages_errors import AnthropicErrors
from kvhive.server.openapi import install_request_bodies
from kvhive.server.prefix_cache import install_prefix_cache_routes
from kvhive.server.protocol import CompletionRequest, CompletionResponse, ModelCard, ModelList
from kvhive.server.request_body import parse_body
from kvhive.server.response_identity import unix_time
from kvhive.server.responses import ResponsesAPI, install_response_routes, response_sweeper
from kvhive.server.tokenize import install_tokenize_routes

if TYPE_CHECKING:
    from kvhive.engine.async_engine import AsyncEngine

KVHIVE_VERSION = "0.1.0"
logger = logging.getLogger(__name__)

# After the engine loop dies: HTTP answers (generation 500, /health 503) for DRAIN_S, then shuts
# down, giving open responses GRACE_S to finish; the process is gone within EXIT_S of the death.
ENGINE_FAILURE_DRAIN_S = 1.0
ENGINE_FAILURE_GRACE_S = 2.0
ENGINE_FAILURE_EXIT_S = 5.0


# Routes outside /v1 that need the API key too.
KEYED_PATHS = frozenset({"/tokenize", "/detokenize", "/reset_prefix_cache", "/tokenizer_info"})


class APIKeyMiddleware:
    """Answers 401 on ``/v1/*`` and KEYED_PATHS (``/tokenize``, ``/detokenize``,
    ``/reset_prefix_cache``, ``/tokenizer_info``) unless the request presents one of the keys:
    ``Authorization: Bearer <key>``, or Anthropic's ``x-api-key: <key>`` when no Authorization is sent.

    ``/health`` and ``/metrics`` stay open (probes and scrapers carry no key).
    """

    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...]) -> None:
        self.app = app
        self.api_keys = tuple(k.encode() for k in api_keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Check the key of HTTP requests under /v1 and to KEYED_PATHS, pass everything else through."""
        if (scope["type"] == "http" and scope["method"] != "OPTIONS"
                and (scope["path"].startswith("/v1") or scope["path"] in KEYED_PATHS)
                and not self._authorized(scope)):
            error = APIError(401, "Invalid or missing API key. Send 'Authorization: Bearer <key>' "
                                  "or 'x-api-key: <key>'.", code="invalid_api_key")
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        if header:
            scheme, _, token = header.partition(b" ")
            if scheme.lower() != b"bearer":
                return False
        else:
            token = next((v for k, v in scope["headers"] if k == b"x-api-key"), b"")
        token = token.strip()
        if not token:
            return False
        # compare_digest against every key: the time taken does not reveal which key nearly matched.
        return any([secrets.compare_digest(token, key) for key in self.api_keys])


@dataclass(frozen=True)
class AppOptions:
    """How the HTTP front of a replica is set up (``kvhive serve``'s flags for it).

    ``api_keys``: the keys /v1 requires (none: open). ``max_request_bytes``: larger request bodies
    are refused with 413 before they are read (None: ``default_max_request_bytes`` of the model's
    context). ``metrics_compat``: "vllm" also exports each metric vLLM has under vLLM's name
    (docs/metrics.md). ``cors``: the browser origins allowed (None: no CORS headers).
    ``tokenizer_info``: serve ``GET /tokenizer_info``. ``tool_call_parser``: how tool calls are
    read from outputs ("auto": by the chat template). ``dashboard``: serve the live page
    (``/dashboard``, ``kvhive.server.dashboard_replica``). ``admin_key``: the key that sees every key's
    sessions and usage there (one of ``api_keys`` too; None: no admin).
    """

    api_keys: tuple[str, ...] = ()
    max_request_bytes: int | None = None
    metrics_compat: str = "none"
    cors: CorsConfig | None = None
    tokenizer_info: bool = False
    tool_call_parser: str = "auto"
    dashboard: bool = True
    admin_key: str | None = None


@dataclass(frozen=True)
class AppServices:
    """What the routes serve from: generation (with its metrics and session service) and the
    Responses API (``kvhive.launch`` builds them)."""

    generation: GenerationService
    responses: ResponsesAPI


def create_app(services: AppServices, options: AppOptions) -> FastAPI:
    """The OpenAI-compatible app over ``services`` (the caller owns the engine's lifecycle); its
    lifespan runs the session and stored-response sweepers."""
    service, responses = services.generation, services.responses
    dashboard = None
    if options.dashboard:
        dashboard = ReplicaDashboard(service, DashboardAccess(True, options.api_keys, options.admin_key))

    @contextlib.asynccontextmanager
    async def sweepers(_app: FastAPI) -> AsyncIterator[None]:
        async with session_sweeper(service.sessions), response_sweeper(responses), dashboard_sampler(dashboard):
            yield

    app = FastAPI(title="kvhive", version=KVHIVE_VERSION, lifespan=sweepers)
    # A query parameter no route takes is a 400 naming it (``kvhive.core.query_params``).
    app.router.route_class = strict_query_route(lambda message, param: bad_request(message, param=param).response())
    app.state.service = service
    app.state.metrics = service.metrics
    max_request_bytes = options.max_request_bytes
    if max_request_bytes is None:
        max_request_bytes = default_max_request_bytes(service.max_model_len)
    app.state.max_request_bytes = max_request_bytes
    created = unix_time()
    install_error_handlers(app)
    install_request_bodies(app, service.served_model_name)
    if dashboard is not None:
        install_dashboard(app, dashboard)       # its usage counter runs inside the checks below
    # The last added runs first: the key is checked, then the body's size, before any route reads it.
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)
    if options.api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=tuple(options.api_keys))
    # Outside both: their errors on /v1/messages* leave in Anthropic's shape too.
    app.add_middleware(AnthropicErrors)
    install_cors(app, options.cors)
    install_info_routes(app, service, created)
    if options.tokenizer_info:
        install_tokenizer_info_route(app, service)
    install_generation_routes(app, service)
    install_messages_routes(app, service)
    install_context_routes(app, service)
    install_response_routes(app, responses)
    install_tokenize_routes(app, service)
    install_prefix_cache_routes(app, service)
    return app


def install_info_routes(app: FastAPI, service: GenerationService, created: int) -> None:
    """Add /health, /version, /metrics, /v1/models and /v1/models/{id} (``created``: the model card's time)."""
    engine = service.engine

    @app.get("/health", response_model=None)
    async def health() -> dict[str, str] | JSONResponse:
        """200 while the engine loop runs; 503 once it has died."""
        if not engine.is_healthy:
            return JSONResponse(status_code=503, content={"status": "engine loop stopped"})
        return {"status": "ok"}

    @app.get("/version")
    async def version() -> dict:
        """kvhive's version, the device and dtype, the CPU and kernel ISA level, and each op's path."""
        return {"version": KVHIVE_VERSION, **engine.runtime_info()}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        """Prometheus text exposition of this app's registry."""
        payload, content_type = service.metrics.render()
        return Response(content=payload, media_type=content_type)

    card = ModelCard(id=service.served_model_name, created=created, max_model_len=service.max_model_len,
                     kvhive_fingerprint=engine.fingerprint, kvhive_block_size=engine.block_size,
                     kvhive_hash_seed=engine.config.cache.hash_seed)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        """The one served model, with its context length."""
        return ModelList(data=[card])

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> ModelCard:
        """The served model's card (ids may hold '/'); 404 in OpenAI's shape for any other id."""
        service.check_model(model_id)
        return card


def install_tokenizer_info_route(app: FastAPI, service: GenerationService) -> None:
    """Add ``GET /tokenizer_info`` (vLLM's endpoint, behind ``--enable-tokenizer-info-endpoint``)."""
    from kvhive.server.tokenizer_info import tokenizer_info

    @app.get("/tokenizer_info")
    async def tokenizer_settings() -> dict:
        """The tokenizer's settings as tokenizer_config.json holds them, the chat template included."""
        return tokenizer_info(service.tokenizer, service.max_model_len)


def install_generation_routes(app: FastAPI, service: GenerationService) -> None:
    """Add /v1/completions and /v1/chat/completions."""

    @app.post("/v1/completions", response_model=None)
    async def completions(raw_request: Request) -> Response | CompletionResponse:
        """OpenAI completions (one prompt, n choices), streamed with SSE when ``stream`` is true."""
        body = await parse_body(raw_request, CompletionRequest)
        return await create_completion(service, body, raw_request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(raw_request: Request) -> Response | ChatCompletionResponse:
        """OpenAI chat completions (n choices), streamed with SSE when ``stream`` is true."""
        body = await parse_body(raw_request, ChatCompletionRequest)
        return await create_chat_completion(service, body, raw_request)


def run_server(app: FastAPI, async_engine: AsyncEngine, host: str, port: int, log_level: str = "info",
               http_limits: HttpLimits | None = None) -> bool:
    """Serve ``app`` over HTTP on a thread and run ``async_engine``'s loop on this (main) thread
    until interrupted.

    Returns False when the HTTP server never started (e.g. the port is taken) or the engine loop
    died: the caller then exits non-zero, so a supervisor restarts the server. ``http_limits``: what
    each connection may send and hold before a request reaches the app (default: ``HttpLimits()``).

    SIGINT/SIGTERM start uvicorn's graceful shutdown; the engine keeps stepping until the HTTP
    server has finished, so in-flight streams complete. If the engine loop dies, its requests fail
    (500) and ``/health`` answers 503 for ENGINE_FAILURE_DRAIN_S; then the HTTP server shuts down,
    and this returns within ENGINE_FAILURE_EXIT_S of the death (past it, the process exits with
    status 1 on its own: closing must not keep a broken server alive).
    """
    logger.info("request bodies over %d bytes are refused (413)", app.state.max_request_bytes)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                            **uvicorn_options(http_limits or HttpLimits()))
    server = uvicorn.Server(config)

    def serve_http() -> None:
        try:
            server.run()
        finally:
            async_engine.stop()

    http = threading.Thread(target=serve_http, name="kvhive-http", daemon=True)
    previous = {sig: signal.signal(sig, server.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
    http.start()
    try:
        async_engine.run()
        if async_engine.error is not None:
            exit_soon(ENGINE_FAILURE_EXIT_S)
            time.sleep(ENGINE_FAILURE_DRAIN_S)      # failed requests get their 500s; probes see 503
            config.timeout_graceful_shutdown = ENGINE_FAILURE_GRACE_S
            server.should_exit = True
        http.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        async_engine.shutdown()
    return server.started and async_engine.error is None


def exit_soon(delay_s: float) -> None:
    """Exit the process with status 1 in ``delay_s`` seconds unless it has exited by then."""
    logger.error("the engine loop died; the server exits with status 1 within %.0f s", delay_s)
    timer = threading.Timer(delay_s, os._exit, args=(1,))
    timer.daemon = True
    timer.start()
