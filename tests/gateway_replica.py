"""A tiny-model kvhive replica that publishes KV events, for the gateway tests.

``python tests/gateway_replica.py --port N [--kv-events tcp://*:P] [--kv-replay tcp://*:R]``

It builds the same tiny engine as ``tests/conftest.py`` (random weights behind the default GGUF's
tokenizer) and stands in for two things ``kvhive serve`` does not have yet:

- KV events: the block pool's ``cache_block`` / ``get_new_blocks`` are wrapped so every block
  registered or evicted in a step goes out as one ``EventBatch`` after that step.
- Sessions: a minimal ``/v1/context`` (create / get / list / delete, ``x-session-id`` echoed on
  completions), so the gateway's session routing can be tested against real processes.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import uuid
from typing import Any

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def wire_kv_events(engine: Any, publisher: Any, block_size: int) -> None:
    """Publish the pool's stored and evicted blocks once per engine step."""
    from kvhive.events import BlockRemoved, BlockStored

    pool = engine.scheduler.kv.pool
    pending: list[Any] = []        # touched only by the engine loop thread
    cache_block, get_new_blocks, step = pool.cache_block, pool.get_new_blocks, engine.step

    def cache_block_and_note(block: Any, block_hash: bytes) -> bool:
        added = cache_block(block, block_hash)
        if added:
            pending.append(BlockStored([block_hash], None, [], block_size))
        return added

    def get_new_blocks_and_note(n: int) -> list[Any]:
        evicted = [b.block_hash for b in itertools.islice(pool.free_queue, n) if b.block_hash is not None]
        blocks = get_new_blocks(n)
        if evicted:
            pending.append(BlockRemoved(evicted))
        return blocks

    def step_and_publish() -> list[Any]:
        outputs = step()
        if pending:
            publisher.publish(list(pending))
            pending.clear()
        return outputs

    pool.cache_block = cache_block_and_note
    pool.get_new_blocks = get_new_blocks_and_note
    engine.step = step_and_publish


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
    parser = argparse.ArgumentParser(description="kvhive gateway-test replica")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--kv-events", default=None)
    parser.add_argument("--kv-replay", default=None)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    import uvicorn

    sys.path.insert(0, TESTS_DIR)
    from conftest import SERVED_MODEL_NAME, TINY_MAX_MODEL_LEN, _build_engine

    from kvhive.events import KVEventPublisher
    from kvhive.server.app import create_app

    engine_args = argparse.Namespace(model="tiny", max_model_len=TINY_MAX_MODEL_LEN, faulty=False)
    async_engine = _build_engine(engine_args)
    publisher = None
    if args.kv_events:
        publisher = KVEventPublisher(args.kv_events, args.kv_replay)
        wire_kv_events(async_engine.engine, publisher, async_engine.engine.config.cache.block_size)
    app = create_app(async_engine, served_model_name=SERVED_MODEL_NAME)
    add_context_stand_in(app, args.port)
    config = uvicorn.Config(app, host="127.0.0.1", port=args.port, log_level="warning",
                            timeout_graceful_shutdown=2)
    async_engine.start()
    try:
        uvicorn.Server(config).run()
    finally:
        async_engine.shutdown()
        if publisher is not None:
            publisher.close()


if __name__ == "__main__":
    main()
