"""``/v1/context``: create a session with a completion, list, inspect, re-TTL and delete sessions.

- ``POST /v1/context`` (header ``x-session-ttl``, default ``--default-session-ttl``; a completion
  body with ``prompt`` or a chat body with ``messages``; ``max_tokens`` defaults to 16) runs that request in a new session and answers it with ``x-session-id``.
- ``GET /v1/context``: the caller's live sessions, prompt-cache pins among them (``"kind": "pin"``,
  ``kvhive.sessions.prefix_pins``). ``GET /v1/context/{id}``: one session, with
  its blocks per tier. ``PATCH /v1/context/{id}``: a new TTL (``{"ttl": N}`` or the header).
  ``DELETE /v1/context/{id}``: forget it and free its blocks.
- ``POST /v1/context/{id}/fork`` (body ``{"ttl": N, "turn": T}``, both optional; the TTL also as
  ``x-session-ttl``, default the parent's): a new session holding what ``id`` held after turn
  ``T`` (default: its latest), sharing its blocks; answered with the new session (its ``id``,
  also in ``x-session-id``) and ``forked_from``.

Another API key's session answers 404, exactly like an unknown, expired or deleted one. What a
session holds and when it ends is ``kvhive.sessions.service``'s; these routes validate and answer.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvhive.core.json_body import BodyError, load_json, off_loop_for
from kvhive.server.chat import create_chat_completion
from kvhive.server.chat_protocol import ChatCompletionRequest
from kvhive.server.completions import create_completion
from kvhive.server.errors import bad_request, body_error
from kvhive.server.generation import GenerationService
from kvhive.server.protocol import CompletionRequest
from kvhive.server.request_body import parse_body_as
from kvhive.sessions.registry import Session
from kvhive.sessions.service import SessionService

# max_tokens of a POST /v1/context body that sets none (OpenAI's legacy completions default):
# creating a context is about caching its prompt, not about generating to the end of the context.
CONTEXT_DEFAULT_MAX_TOKENS = 16


def session_info(session: Session, blocks: dict[str, int] | None = None) -> dict[str, Any]:
    """A session as the API shows it."""
    info: dict[str, Any] = {"id": session.session_id, "object": "context", "model": session.model,
                            "created": int(session.created), "expires_at": int(session.expires),
                            "ttl": session.ttl_s, "tokens": session.num_tokens,
                            "num_blocks": len(session.block_hashes), "turns": session.num_turns,
                            "busy": session.busy, "kind": session.kind}
    if blocks is not None:
        info["blocks"] = blocks
    return info


def install_context_routes(app: FastAPI, service: GenerationService) -> None:
    """Add the /v1/context routes over the service's sessions, and export the session metrics."""
    service.metrics.watch_sessions(service.sessions.stats, service.engine.pinned_blocks_by_tier)
    install_create_route(app, service)
    install_session_routes(app, service)


def new_session_ttl(sessions: SessionService, raw_request: Request) -> int:
    """The TTL of the session ``POST /v1/context`` creates: ``x-session-ttl``, else the server's
    --default-session-ttl (documented); 400 for a bad value or an ``x-session-id``."""
    header = raw_request.headers.get("x-session-ttl")
    ttl = sessions.config.default_ttl_s if header is None else sessions.parse_ttl(header, "x-session-ttl")
    if raw_request.headers.get("x-session-id"):
        raise bad_request("POST /v1/context creates a session; send x-session-id to "
                          "/v1/completions or /v1/chat/completions to use one", param="x-session-id")
    return ttl


def context_body_model(data: dict[str, Any]) -> type[ChatCompletionRequest] | type[CompletionRequest]:
    """A ``POST /v1/context`` body is a chat request when it has ``messages``, else a completion."""
    return ChatCompletionRequest if "messages" in data else CompletionRequest


def install_create_route(app: FastAPI, service: GenerationService) -> None:
    """Add ``POST /v1/context``: a completion or chat completion run in a new session."""

    @app.post("/v1/context", response_model=None)
    async def create_context(raw_request: Request) -> Any:
        """Run a completion or chat completion in a new session; answer it with x-session-id."""
        ttl = new_session_ttl(service.sessions, raw_request)
        body = await parse_body_as(raw_request, context_body_model)
        if isinstance(body, ChatCompletionRequest):
            if body.max_tokens is None and body.max_completion_tokens is None:
                body.max_tokens = CONTEXT_DEFAULT_MAX_TOKENS
            if body.conversation_id is not None:
                raise bad_request("'conversation_id' cannot be used with POST /v1/context; the "
                                  "session id comes back in x-session-id", param="conversation_id")
            return await create_chat_completion(service, body, raw_request, new_session_ttl=ttl)
        if body.max_tokens is None:
            body.max_tokens = CONTEXT_DEFAULT_MAX_TOKENS
        return await create_completion(service, body, raw_request, new_session_ttl=ttl)


def body_object(raw: bytes, example: str) -> dict[str, Any]:
    """An optional JSON object body (empty: ``{}``); 400 for anything else, showing ``example``."""
    if not raw.strip():
        return {}
    try:
        data = load_json(raw)
    except BodyError as exc:
        raise body_error(exc) from None
    if not isinstance(data, dict):
        raise bad_request(f"Request body must be a JSON object like {example}")
    return data


def patched_ttl(raw: bytes, header: str | None) -> tuple[Any, str]:
    """The TTL a ``PATCH /v1/context/{id}`` asks for and the field it came in: the body's ``ttl``,
    else the ``x-session-ttl`` header; 400 for a body that is not a JSON object of ``ttl`` alone."""
    data = body_object(raw, '{"ttl": 600}')
    stray = next((key for key in data if key != "ttl"), None)
    if stray is not None:
        raise bad_request(f"Unrecognized request argument supplied: {stray[:80]}", param=stray[:80])
    if "ttl" in data:
        return body_ttl(data["ttl"]), "ttl"
    if header is None:
        raise bad_request("'ttl' is required: the session's new time to live in seconds, as {\"ttl\": 600} "
                          "or an x-session-ttl header", param="ttl", code="missing_session_ttl")
    return header, "x-session-ttl"


def body_ttl(value: Any) -> Any:
    """A body's ``ttl`` as sent; 400 for a string (a JSON body's seconds are a number, as OpenAI's
    fields are: "600" is not an integer; the header's are text)."""
    if isinstance(value, str):
        raise bad_request(f"'ttl' must be a whole number of seconds, got {value[:40]!r}", param="ttl",
                          code="invalid_session_ttl")
    return value


# The fields a fork body may hold, and the largest turn number it may name.
FORK_FIELDS = ("ttl", "turn")
MAX_TURN_NUMBER = 2**31 - 1


def fork_fields(raw: bytes, header: str | None) -> tuple[Any, str, int | None]:
    """What a ``POST /v1/context/{id}/fork`` asks for: the TTL and the field it came in (None: the
    parent's), and the turn (None: the latest); 400 for a body that is not a JSON object of
    FORK_FIELDS, or a turn that is not a whole number in [1, MAX_TURN_NUMBER]."""
    data = body_object(raw, '{"ttl": 600, "turn": 2}')
    stray = next((key for key in data if key not in FORK_FIELDS), None)
    if stray is not None:
        raise bad_request(f"Unrecognized request argument supplied: {stray[:80]}", param=stray[:80])
    turn = data.get("turn")
    if turn is not None and (isinstance(turn, bool) or not isinstance(turn, int)
                             or not 1 <= turn <= MAX_TURN_NUMBER):
        raise bad_request(f"'turn' must be a whole number from 1 (the session's first turn), got {turn!r}",
                          param="turn")
    if data.get("ttl") is not None:
        return body_ttl(data["ttl"]), "ttl", turn
    return header, "x-session-ttl", turn


def install_session_routes(app: FastAPI, service: GenerationService) -> None:
    """Add the routes over existing sessions: list, inspect, re-TTL and delete."""
    sessions = service.sessions

    async def lookup(raw_request: Request, session_id: str) -> Session:
        return await sessions.find(session_id, service.owner_of(raw_request))

    @app.get("/v1/context")
    async def list_contexts(raw_request: Request) -> dict[str, Any]:
        """The caller's live sessions."""
        return {"object": "list", "data": [session_info(s) for s in sessions.list(service.owner_of(raw_request))]}

    @app.get("/v1/context/{session_id}")
    async def get_context(session_id: str, raw_request: Request) -> dict[str, Any]:
        """One session: tokens held, blocks per tier (device and each store tier), times, model."""
        session = await lookup(raw_request, session_id)
        blocks = await service.engine.session_blocks_by_tier([bytes.fromhex(h) for h in session.block_hashes])
        return session_info(session, blocks)

    @app.patch("/v1/context/{session_id}")
    async def patch_context(session_id: str, raw_request: Request) -> dict[str, Any]:
        """Set a new TTL (body ``{"ttl": N}`` or header x-session-ttl); expiry becomes now + TTL."""
        session = await lookup(raw_request, session_id)
        raw = await raw_request.body()
        value, param = await off_loop_for(raw, patched_ttl, raw, raw_request.headers.get("x-session-ttl"))
        sessions.set_ttl(session, sessions.parse_ttl(value, param))
        return session_info(session)

    @app.post("/v1/context/{session_id}/fork", response_model=None)
    async def fork_context(session_id: str, raw_request: Request) -> JSONResponse:
        """A new session sharing the session's blocks up to a turn (``SessionService.fork``)."""
        raw = await raw_request.body()
        value, param, turn = await off_loop_for(raw, fork_fields, raw, raw_request.headers.get("x-session-ttl"))
        ttl = None if value is None else sessions.parse_ttl(value, param)
        child, _ = await sessions.fork(service.owner_of(raw_request), session_id, ttl, turn)
        return JSONResponse({**session_info(child), "forked_from": session_id},
                            headers={"x-session-id": child.session_id})

    @app.delete("/v1/context/{session_id}")
    async def delete_context(session_id: str, raw_request: Request) -> dict[str, Any]:
        """Forget the session and free its blocks (a running turn frees its own when it ends)."""
        session = await lookup(raw_request, session_id)
        sessions.end(session)
        return {"id": session.session_id, "object": "context.deleted", "deleted": True}


@contextlib.asynccontextmanager
async def background_task(coroutine: Coroutine[Any, Any, None]) -> AsyncIterator[None]:
    """Run ``coroutine`` as a task while the context is open; cancel it on exit."""
    task = asyncio.create_task(coroutine)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def session_sweeper(sessions: SessionService) -> contextlib.AbstractAsyncContextManager[None]:
    """Run the sessions' expiry sweep for the app's lifetime (the registry pinned the sessions it loaded)."""
    return background_task(sessions.run_sweeper())
