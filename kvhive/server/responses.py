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
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response

from kvhive.core.retention import RetentionSpec
from kvhive.server.chat import chat_prompt_token_ids
from kvhive.server.choices import collect
from kvhive.server.context import background_task
from kvhive.server.errors import APIError, bad_request
from kvhive.server.generation import GenerationService
from kvhive.server.logprobs import SentToken, chat_logprobs
from kvhive.server.prompt_cache import PromptCache
from kvhive.server.protocol import ChatMessage, ChatTokenLogprob, SamplingRequest
from kvhive.server.request_body import parse_body
from kvhive.server.response_identity import unix_time
from kvhive.server.responses_items import chat_messages, check_call_ids, input_items
from kvhive.server.responses_output import OutputItems
from kvhive.server.responses_protocol import (
    EventWriter,
    IncompleteDetails,
    InputTokensDetails,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    check_unsupported,
    logprobs_wanted,
)
from kvhive.server.sampling_fields import pick
from kvhive.server.session_turns import open_session, sse_response_ending_turns
from kvhive.server.sse import ClosingStreamingResponse
from kvhive.server.structured import text_format, text_structured_spec
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

logger = logging.getLogger(__name__)

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


@dataclass
class Turn:
    """One request's response object as it is built, and its storing once it is done."""

    api: ResponsesAPI
    body: ResponsesRequest
    owner: str | None
    response_id: str
    conversation_id: str | None                  # None: not stored
    items: list[dict[str, Any]]                  # this request's input items
    session: Session | None
    with_logprobs: bool                          # ``include`` asks for the output tokens' logprobs
    plan: ToolPlan = NO_PLAN
    # The session's finished turns when this one began (None: it runs beside the session, or none).
    turns_before: int | None = None
    stored: bool = False
    response: ResponseObject = field(init=False)
    outputs: OutputItems = field(init=False)

    def __post_init__(self) -> None:
        body, defaults = self.body, self.api.service.defaults
        self.response = ResponseObject(
            id=self.response_id, created_at=unix_time(), status="in_progress", instructions=body.instructions,
            max_output_tokens=body.max_output_tokens, model=body.model, output=[],
            previous_response_id=body.previous_response_id, store=body.store,
            temperature=pick(body.temperature, defaults.temperature, 1.0),
            top_p=pick(body.top_p, defaults.top_p, 1.0), top_logprobs=body.top_logprobs or 0,
            user=body.user, metadata=body.metadata or {}, text={"format": text_format(body.text)},
            parallel_tool_calls=True if body.parallel_tool_calls is None else body.parallel_tool_calls,
            tools=[dict(f.definition["function"], type="function") for f in self.plan.functions],
            tool_choice=body.tool_choice if body.tool_choice is not None else "auto",
            prompt_cache_key=body.prompt_cache_key, prompt_cache_retention=body.prompt_cache_retention)
        self.outputs = OutputItems(self.plan, self.logprobs)

    def logprobs(self, tokens: tuple[SentToken, ...]) -> list[ChatTokenLogprob]:
        """The tokens' logprobs as ``output_text`` parts and text deltas carry them (as chat's)."""
        if not self.with_logprobs:
            return []
        return chat_logprobs(tokens, self.api.service.tokenizer).content

    def finish(self, result: TextDelta, streamed: bool = False) -> dict[str, Any]:
        """The final response object for the whole output ``result`` (read into output items here
        unless they were ``streamed``); stored when asked."""
        incomplete = result.finish_reason == "length"
        status = "incomplete" if incomplete else "completed"
        self.response.status = status
        self.response.incomplete_details = IncompleteDetails() if incomplete else None
        if not streamed:
            self.outputs.tokens = list(result.tokens)
            self.outputs.read_whole(result.text)
        self.response.output = self.outputs.output(status)
        self.response.usage = ResponseUsage(
            input_tokens=result.num_prompt_tokens, output_tokens=result.num_output_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=result.num_cached_tokens),
            total_tokens=result.num_prompt_tokens + result.num_output_tokens)
        answer = self.response.model_dump(mode="json")
        if self.body.store:
            session = self.session
            expires = session.expires if session is not None else unix_time()
            stored = StoredResponse(self.owner, answer, self.items, self.chain(result))
            self.api.store.add(stored, expires)
            self.stored = True
            self.api.sessions.pin_chain(self.owner, self.response_id, stored.chain)
        self.api.created[status] += 1
        return answer

    def chain(self, result: TextDelta) -> list[str]:
        """This response's chain (its prompt's and output's full blocks): what its session turn
        recorded the session holds after it, else the request's own blocks as the engine reported
        them (a branch that ran beside its busy session); none when neither is known. Stored with it
        and pinned beside the session, which later turns move on."""
        session = self.session
        if session is None:
            return []
        if self.turns_before is not None and session.num_turns > self.turns_before:
            return list(session.block_hashes)
        return [h.hex() for h in result.block_hashes or ()]

    def fail(self, exc: Exception) -> ResponseObject:
        """The response object of a turn the engine failed, or whose storing failed (never stored)."""
        self.response.status = "failed"
        self.api.created["failed"] += 1
        self.response.error = ResponseError(message=f"Engine error: {type(exc).__name__}: {exc}")
        return self.response

    def not_stored(self, exc: SessionNotDurable) -> ResponseObject:
        """The response object of a turn whose record could not be written (counted as failed)."""
        self.response.status = "failed"
        self.api.created["failed"] += 1
        self.response.error = ResponseError(code=exc.code, message=exc.message)
        return self.response

    def close(self) -> None:
        """After the turn: a new conversation whose first response was not stored ends its session
        (nobody else knows its id, so nothing else stores in it: no backend read needed). A
        continuation keeps its session: its conversation stores the responses before it."""
        if (self.conversation_id is not None and not self.stored and self.session is not None
                and self.body.previous_response_id is None):
            self.api.sessions.end(self.session)

    async def events(self, deltas: AsyncIterator[TextDelta]) -> AsyncIterator[str]:
        """The stream events of the turn, ending with response.completed (or response.incomplete);
        an engine error ends them with response.failed (the response is not stored)."""
        event = EventWriter()
        outputs = self.outputs
        yield event("response.created", response=self.response)
        yield event("response.in_progress", response=self.response)
        for kind, fields in outputs.start():
            yield event(kind, **fields)
        parts: list[str] = []
        last: TextDelta | None = None
        try:
            async with contextlib.aclosing(deltas):
                async for delta in deltas:
                    last = delta
                    parts.append(delta.text)
                    for kind, fields in outputs.add(delta.text, delta.tokens, self.with_logprobs):
                        yield event(kind, **fields)
        except SessionNotDurable as exc:          # the session turn's record could not be written
            yield event("response.failed", response=self.not_stored(exc))
            return
        except Exception as exc:  # noqa: BLE001 - reported to the client as OpenAI's response.failed
            logger.exception("engine error while streaming response %s", self.response_id)
            yield event("response.failed", response=self.fail(exc))
            return
        assert last is not None
        for kind, fields in outputs.finish():
            yield event(kind, **fields)
        try:
            answer = self.finish(TextDelta("".join(parts), last.finish_reason, last.num_prompt_tokens,
                                           last.num_cached_tokens, last.num_output_tokens,
                                           block_hashes=last.block_hashes), streamed=True)
        except SessionNotDurable as exc:
            yield event("response.failed", response=self.not_stored(exc))
            return
        for kind, fields in outputs.done_events(answer["output"]):
            yield event(kind, **fields)
        yield event(f"response.{answer['status']}", response=answer)


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
