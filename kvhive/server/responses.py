"""``/v1/responses`` (OpenAI's Responses API: text and function calls): create, continue, fetch, list input, delete.

The prompt of a request is the model's chat template (as ``/v1/chat/completions`` renders it) over
this request's ``instructions`` as a system message (never carried over), the stored conversation
of ``previous_response_id`` (the inputs and outputs of every response back to its first turn,
without their instructions), then this request's ``input``.

A stored response (``store``, the default) keeps its conversation's KV in a session whose id is the
conversation's (``kvhive.sessions.response_store``): a follow-up continues that session and computes only its new
tokens; a branch (a second follow-up of one response) diverges from what the session holds, falls
back to prefix matching, and the session then follows the branch. A session runs one request at a
time: a request continuing a conversation whose session is busy with another runs beside it (prefix
caching finds the conversation's blocks) and is stored in the conversation; the session keeps
following the request it runs. ``store: false`` runs outside any session (prefix caching still
finds the conversation's blocks) and stores nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response

from kvhive.core.retention import RetentionSpec
from kvhive.server.chat import chat_prompt_token_ids
from kvhive.server.chat_protocol import ChatMessage
from kvhive.server.choices import collect
from kvhive.server.context import background_task
from kvhive.server.errors import APIError, bad_request
from kvhive.server.generation import GenerationService
from kvhive.server.prompt_cache import PromptCache
from kvhive.server.protocol import SamplingRequest
from kvhive.server.request_body import parse_body
from kvhive.server.responses_items import chat_messages, check_call_ids, input_items
from kvhive.server.responses_protocol import (
    ResponsesRequest,
    check_unsupported,
    logprobs_wanted,
)
from kvhive.server.responses_turn import Turn
from kvhive.server.session_turns import open_session, sse_response_ending_turns
from kvhive.server.sse import ClosingStreamingResponse
from kvhive.server.structured import text_structured_spec
from kvhive.server.text_deltas import TextDelta
from kvhive.server.tools import NO_PLAN, ToolPlan, responses_functions, tool_choice, tool_plan
from kvhive.sessions.registry import Session, SessionBusy, SessionNotDurable, SessionNotFound
from kvhive.sessions.response_store import (
    ResponseStats,
    ResponseStore,
    StoredResponse,
    conversation_of,
    new_conversation_id,
    new_response_id,
)
from kvhive.sessions.service import DATA_CHECK_INTERVAL_S, NO_TURN, SWEEP_INTERVAL_S, SessionTurn

# A stored response's answer names it in this header, so a gateway learns which replica holds it.
RESPONSE_ID_HEADER = "x-kvhive-response-id"


class ResponsesAPI:
    """Runs Responses-API requests over the generation service, the session service and the store."""

    def __init__(self, service: GenerationService, store: ResponseStore) -> None:
        self.service = service
        self.sessions = service.sessions
        self.store = store
        self.created: Counter[str] = Counter()       # responses created, by final status
        self.pin_loaded_chains()

    def pin_loaded_chains(self) -> int:
        """Pin the chains of the stored responses loaded at start (a local backend's; a shared one
        loads on use and its branches are pinned by the replica that ran them); how many."""
        return sum(self.sessions.pin_chain(stored.owner, stored.response_id, stored.chain)
                   for stored in self.store.live_responses() if stored.chain)

    def stats(self) -> ResponseStats:
        """The store's counts and the responses created by status."""
        return replace(self.store.stats(), created_total=dict(self.created))

    # ------------------------------------------------------------ lookups

    async def lookup(self, raw_request: Request, response_id: str, param: str | None = None) -> StoredResponse:
        """The caller's stored response; SessionNotFound (404) otherwise."""
        return await self.store.aget(response_id, self.service.owner_of(raw_request), param)

    async def history(self, raw_request: Request, body: ResponsesRequest) -> list[StoredResponse]:
        """The stored responses that ``previous_response_id`` continues, first turn first."""
        if body.previous_response_id is None:
            return []
        previous = await self.lookup(raw_request, body.previous_response_id, "previous_response_id")
        if previous.model != body.model:
            raise bad_request(f"Response '{previous.response_id}' was written by model '{previous.model}', "
                              f"not '{body.model}'", param="model", code="response_model_mismatch")
        return self.store.history(previous)

    async def prompt_token_ids(self, body: ResponsesRequest, history: list[StoredResponse],
                               items: list[dict[str, Any]], plan: ToolPlan = NO_PLAN) -> list[int]:
        """The chat template over instructions, the stored conversation and the new input, with the
        plan's tools (a long conversation rendered and tokenized off the event loop); 400 naming an
        input ``function_call_output`` that answers no earlier call."""
        earlier = [item for stored in history for item in (*stored.input_items, *stored.response["output"])]
        check_call_ids(earlier, items)
        messages = [] if body.instructions is None else [ChatMessage(role="system", content=body.instructions)]
        messages += chat_messages([*earlier, *items])
        return await chat_prompt_token_ids(self.service, messages, param="input", plan=plan)

    # ------------------------------------------------------------ sessions

    async def open_session(self, raw_request: Request, body: ResponsesRequest, conversation_id: str,
                           num_tokens: int) -> tuple[SessionTurn, Session]:
        """The turn of the conversation's session, busy with this request (created when it has
        none), and the session; a request whose session is busy with another (only a continuation
        can find it so) gets ``NO_TURN``, running beside the session, and the session, whose expiry
        it is stored under."""
        owner = self.service.owner_of(raw_request)
        self.store.check_room(conversation_id, owner)
        try:
            turn = await open_session(self.service, raw_request, body.model, num_tokens,
                                      conversation_id=conversation_id, wait_if_busy=False)
        except SessionBusy:
            with contextlib.suppress(SessionNotFound):      # ended meanwhile: open it again below
                return NO_TURN, await self.sessions.find(conversation_id, owner)
            turn = await open_session(self.service, raw_request, body.model, num_tokens,
                                      conversation_id=conversation_id)
        assert turn.session is not None
        return turn, turn.session

    async def end_unused_session(self, conversation_id: str, owner: str | None) -> None:
        """End the session of a conversation that stores no response (its last response was
        deleted): its KV is freed."""
        if not await self.store.ais_empty(conversation_id, owner):
            return
        try:
            session = await self.sessions.find(conversation_id, owner)
        except SessionNotFound:
            return                                          # expired or deleted already
        self.sessions.end(session)

    # ------------------------------------------------------------ create

    def check_request(self, body: ResponsesRequest, raw_request: Request) -> int | None:
        """400 (404 for another model) for what a request may not ask; returns the top alternatives
        per output token it wants (None: no logprobs)."""
        self.service.check_model(body.model)
        self.service.check_priority(body.priority)
        check_unsupported(body)
        num_logprobs = logprobs_wanted(body)
        if raw_request.headers.get("x-session-id"):
            raise bad_request("x-session-id cannot be used with /v1/responses; continue a response with "
                              "'previous_response_id'", param="x-session-id")
        return num_logprobs

    async def open_conversation(self, raw_request: Request, body: ResponsesRequest, num_tokens: int
                                ) -> tuple[str | None, SessionTurn, Session | None]:
        """The conversation a stored response joins (``previous_response_id``'s, else a new one), the
        turn of its session and the session (``open_session``); ``(None, NO_TURN, None)`` for a
        response not stored."""
        if not body.store:
            return None, NO_TURN, None
        conversation_id = (conversation_of(body.previous_response_id) if body.previous_response_id
                           else new_conversation_id())
        assert conversation_id is not None
        return conversation_id, *await self.open_session(raw_request, body, conversation_id, num_tokens)

    async def create(self, body: ResponsesRequest, raw_request: Request) -> Response:
        """Validate, run, store (with ``store``) and answer one request, streamed or whole."""
        service = self.service
        num_logprobs = self.check_request(body, raw_request)
        items = input_items(body)
        owner = service.owner_of(raw_request)
        history = await self.history(raw_request, body)
        functions = responses_functions(body.tools)
        plan = await tool_plan(service.engine, service.tokenizer.chat_template, service.tool_call_parser, functions,
                               tool_choice(body.tool_choice, functions, flat=True),
                               body.parallel_tool_calls is not False, flat=True)
        token_ids = await self.prompt_token_ids(body, history, items, plan)
        max_tokens = service.resolve_max_tokens(body.max_output_tokens, len(token_ids), "max_output_tokens", "input")
        structured = await text_structured_spec(service.engine, body.text, body.tools, body.tool_choice)
        sampling = plan.with_spec(service.sampling_params(
            SamplingRequest(model=body.model, temperature=body.temperature, top_p=body.top_p), max_tokens,
            num_logprobs, structured=structured))
        salt = service.cache_salt_for(owner, None)
        cache = await service.open_cache(raw_request, body, token_ids, salt)
        if body.store and cache.engine_retention is None:
            # A retention at the default priority changes no eviction; it has the engine report the
            # request's own block hashes, this response's chain when it ran beside its session.
            cache = replace(cache, retention=RetentionSpec())
        try:
            conversation_id, session_turn, session = await self.open_conversation(
                raw_request, body, len(token_ids) + max_tokens)
        except BaseException:
            cache.end(None, 0)                   # refused: the pins it would have created are dropped
            raise
        response_id = new_response_id(conversation_id)
        deltas = service.stream(response_id, token_ids, sampling, (), salt, session_turn, cache=cache,
                                priority=body.priority)
        turn = Turn(self, body, owner, response_id, conversation_id, items, session, num_logprobs is not None, plan,
                    turns_before=None if session_turn.session is None else session_turn.session.num_turns)
        headers = {RESPONSE_ID_HEADER: response_id} if body.store else {}
        if body.stream:
            return self.stream_answer(turn, deltas, headers, session_turn, cache)
        return await self.whole_answer(turn, deltas, raw_request, headers)

    def stream_answer(self, turn: Turn, deltas: AsyncIterator[TextDelta], headers: dict[str, str],
                      session_turn: SessionTurn, cache: PromptCache) -> Response:
        """The SSE answer of ``turn``; in a session, the turn is closed once sending ends, however
        it ends (and so is the pins' turn)."""
        streaming = sse_response_ending_turns(turn.events(deltas), headers, session_turn, cache)
        if isinstance(streaming, ClosingStreamingResponse):
            # Called however sending ends, after the turn has ended; also when the client left
            # before the stream started (then the events' code never ran).
            end_turn = streaming.on_close

            def end_turn_and_close() -> None:
                end_turn()
                turn.close()

            streaming.on_close = end_turn_and_close
        return streaming

    async def whole_answer(self, turn: Turn, deltas: AsyncIterator[TextDelta], raw_request: Request,
                           headers: dict[str, str]) -> Response:
        """The non-streamed answer of ``turn`` (stored when asked); 499 if the client left, the
        collect's 500 (counted as failed) if the engine failed. The turn is closed either way."""
        try:
            try:
                result = await collect(deltas, raw_request)
            except APIError:
                self.created["failed"] += 1            # the engine failed: collect's 500
                raise
            if result is None:
                return Response(status_code=499)          # the client is gone; nobody reads this
            return JSONResponse(turn.finish(result), headers=headers)
        except SessionNotDurable:
            self.created["failed"] += 1                # its record could not be written: 507
            raise
        finally:
            turn.close()


async def sweep_expired_responses(api: ResponsesAPI) -> None:
    """Forever: drop expired conversations (their sessions expire with them and free their KV);
    republish the conversations held here when the shared backend may lack them (and ask it
    every DATA_CHECK_INTERVAL_S)."""
    last_check = time.monotonic()
    while True:
        await asyncio.sleep(SWEEP_INTERVAL_S)
        for conversation in api.store.pop_expired():
            api.sessions.unpin_chains(conversation.owner, conversation.responses)
        api.store.republish_if_wanted()
        if time.monotonic() - last_check >= DATA_CHECK_INTERVAL_S:
            last_check = time.monotonic()
            await api.store.check_backend()


def response_sweeper(api: ResponsesAPI) -> contextlib.AbstractAsyncContextManager[None]:
    """Run ``sweep_expired_responses`` for the app's lifetime."""
    return background_task(sweep_expired_responses(api))


def input_items_page(stored: StoredResponse, limit: int, order: Literal["asc", "desc"],
                     after: str | None) -> dict[str, Any]:
    """One page of a stored response's input items in OpenAI's list shape: ``limit`` items in
    ``order``, after the item ``after`` (400 when the response has no such item)."""
    items = stored.input_items if order == "asc" else stored.input_items[::-1]
    ids = [item["id"] for item in items]
    if after is not None:
        if after not in ids:
            raise bad_request(f"No input item '{after}' in response '{stored.response_id}'", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


def install_response_routes(app: FastAPI, api: ResponsesAPI) -> None:
    """Add the /v1/responses routes, and export their metrics."""
    api.service.metrics.watch_responses(api.stats)

    @app.post("/v1/responses", response_model=None)
    async def create_response(raw_request: Request) -> Response:
        """Create a response (continuing ``previous_response_id``), streamed with SSE when ``stream``."""
        body = await parse_body(raw_request, ResponsesRequest)
        return await api.create(body, raw_request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, raw_request: Request) -> dict[str, Any]:
        """A stored response object."""
        return (await api.lookup(raw_request, response_id)).response

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, raw_request: Request,
                               limit: int = Query(20, ge=1, le=100),
                               order: Literal["asc", "desc"] = "desc",
                               after: str | None = None) -> dict[str, Any]:
        """The input items of a stored response's request (OpenAI's list shape, newest first by default)."""
        stored = await api.lookup(raw_request, response_id)
        return input_items_page(stored, limit, order, after)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, raw_request: Request) -> dict[str, Any]:
        """Forget a stored response; its conversation's KV is freed when no response of it is left."""
        stored = await api.lookup(raw_request, response_id)
        api.sessions.unpin_chains(stored.owner, [response_id])
        if api.store.delete(stored):
            conversation_id = conversation_of(response_id)
            assert conversation_id is not None
            await api.end_unused_session(conversation_id, stored.owner)
        return {"id": response_id, "object": "response", "deleted": True}
