"""A request's session turn as the HTTP layer opens it: the ``x-session-id`` header and the body's
session fields checked, the turn opened by ``SessionService.open_turn``, the header that names the
session in the answer, and the SSE response that ends the turn even if its stream never started."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from kvhive.server.errors import bad_request
from kvhive.server.prompt_cache import NO_PROMPT_CACHE, PromptCache
from kvhive.server.sse import sse_response
from kvhive.sessions.registry import check_session_id
from kvhive.sessions.service import NO_TURN, SessionTurn

if TYPE_CHECKING:
    from kvhive.server.generation import GenerationService


def session_headers(turn: SessionTurn) -> dict[str, str]:
    """The response headers that name the request's session (``x-session-id``); none outside one."""
    return {} if turn.session is None else {"x-session-id": turn.session.session_id}


async def open_session(service: GenerationService, raw_request: Request, model: str, num_tokens: int, *,
                       conversation_id: str | None = None, new_ttl: int | None = None,
                       end_session: bool = False, n: int = 1, wait_if_busy: bool = True,
                       turn_number: int | None = None) -> SessionTurn:
    """The session turn this request runs in (``SessionService.open_turn``): a new session
    (``new_ttl``), the one named by ``x-session-id`` or ``conversation_id``, or ``NO_TURN``.
    ``num_tokens`` is prompt + max output. A request of ``n`` > 1 choices cannot run in a
    session (400, before any session is touched); nor can a ``turn_number`` outside one.
    ``turn_number``: 409 unless it is the session's next turn (``check_turn_number``). An
    ``x-session-ttl`` header is a 400 unless the request creates its session (``new_ttl``)."""
    header = raw_request.headers.get("x-session-id")
    if header:
        check_session_id(header, "x-session-id")
    if new_ttl is None and "x-session-ttl" in raw_request.headers:
        raise bad_request("x-session-ttl sets the TTL of the session POST /v1/context creates; a request "
                          "that uses a session keeps its TTL (change it with PATCH /v1/context/{id})",
                          param="x-session-ttl")
    if turn_number is not None and not (header or conversation_id or new_ttl is not None):
        raise bad_request("'turn_number' counts the turns of a session: send it with x-session-id, "
                          "conversation_id or POST /v1/context", param="turn_number")
    if n > 1 and (header or conversation_id or new_ttl is not None):
        raise bad_request(f"'n' must be 1 in a session (x-session-id, conversation_id or POST "
                          f"/v1/context): a session holds one continuation, got n={n}", param="n")
    return await service.sessions.open_turn(service.owner_of(raw_request), model, num_tokens,
                                            session_id=header or None, conversation_id=conversation_id,
                                            new_ttl=new_ttl, end_session=end_session,
                                            wait_if_busy=wait_if_busy, turn_number=turn_number)


async def open_session_after(service: GenerationService, cache: PromptCache, raw_request: Request, model: str,
                             num_tokens: int, **session: Any) -> SessionTurn:
    """``open_session`` for a request whose pins are open: a refusal ends the pins' turn (the
    pins it would have created are dropped) before it is raised."""
    try:
        return await open_session(service, raw_request, model, num_tokens, **session)
    except BaseException:
        cache.end(None, 0)
        raise


def sse_response_ending_turns(events: AsyncIterator[str], headers: dict[str, str], turn: SessionTurn = NO_TURN,
                               cache: PromptCache = NO_PROMPT_CACHE) -> StreamingResponse:
    """The SSE response over ``events``; a session's turn and the pins' turn end even if the
    stream never started (a no-op when the stream ended them, the usual case)."""
    if cache.pins is None:
        return sse_response(events, headers, None if turn is NO_TURN else turn.end)

    def end_turns() -> None:
        turn.end()
        cache.end(None, 0)
    return sse_response(events, headers, end_turns)

