"""A real ``kvhive serve`` replica for the gateway tests, plus a stand-in ``/v1/context``.

``python tests/gateway_replica.py [kvhive serve flags]`` (e.g. ``--port N --kv-events tcp://*:P
--kv-events-replay tcp://*:R``)

The engine is built exactly as ``kvhive serve`` builds it: the serve flags of ``kvhive/cli.py``,
``build_engine_config`` (so ``EngineConfig(kv_events=..., kv_events_replay=...)``), ``LLMEngine``
on the default model, whose KV manager publishes the pool's BlockStored / BlockRemoved events, and
the server's ``create_app``. The one addition: until the server has ``/v1/context`` (the sessions
issue), a minimal one (create / get / list / delete, ``x-session-id`` echoed on completions) lets
the gateway's session routing be tested against real processes. It is left out as soon as the
server's app has its own.
"""

from __future__ import annotations

import argparse
import uuid
from typing import Any


def add_context_stand_in(app: Any, port: int) -> None:
    """A minimal /v1/context: sessions are ids this replica knows; x-session-id is echoed."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    sessions: set[str] = set()

    def missing(session_id: str) -> JSONResponse:
        return JSONResponse(status_code=404, content={"error": {
            "message": f"session {session_id} not found", "type": "invalid_request_error",
            "param": None, "code": "session_not_found"}})

    @app.middleware("http")
    async def echo_session(request: Request, call_next: Any) -> Any:
        response = await call_next(request)
        session_id = request.headers.get("x-session-id")
        if session_id and request.url.path in ("/v1/completions", "/v1/chat/completions"):
            sessions.add(session_id)          # an unknown id creates the session implicitly
            response.headers["x-session-id"] = session_id
        return response

    @app.post("/v1/context")
    async def create() -> JSONResponse:
        session_id = f"sess-{uuid.uuid4().hex[:12]}"
        sessions.add(session_id)
        return JSONResponse({"id": session_id, "port": port}, headers={"x-session-id": session_id})

    @app.get("/v1/context")
    async def list_sessions() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": s, "port": port} for s in sorted(sessions)]})

    @app.get("/v1/context/{session_id}")
    async def get(session_id: str) -> JSONResponse:
        if session_id not in sessions:
            return missing(session_id)
        return JSONResponse({"id": session_id, "port": port})

    @app.delete("/v1/context/{session_id}")
    async def delete(session_id: str) -> JSONResponse:
        if session_id not in sessions:
            return missing(session_id)
        sessions.discard(session_id)
        return JSONResponse({"id": session_id, "deleted": True})


def main() -> None:
    from kvhive import cli

    parser = argparse.ArgumentParser(description="kvhive serve, for the gateway tests")
    cli._add_serve_args(parser)
    args = parser.parse_args()
    config = cli.build_engine_config(args)
    import torch

    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    import uvicorn

    from kvhive.engine import AsyncEngine, LLMEngine
    from kvhive.server.app import create_app

    async_engine = AsyncEngine(LLMEngine(config))
    app = create_app(async_engine, served_model_name=config.served_model_name)
    if not any(getattr(route, "path", None) == "/v1/context" for route in app.routes):
        add_context_stand_in(app, args.port)
    server = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=2)
    async_engine.start()
    try:
        uvicorn.Server(server).run()
    finally:
        async_engine.shutdown()


if __name__ == "__main__":
    main()
