"""One ``/v1/responses`` request's turn: its response object as it is built (output items, usage,
status), its stream events, and its storing in the response store once it is done."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvhive.server.chat_protocol import ChatTokenLogprob
from kvhive.server.logprobs import SentToken, chat_logprobs
from kvhive.server.response_identity import unix_time
from kvhive.server.responses_output import OutputItems
from kvhive.server.responses_protocol import (
    EventWriter,
    IncompleteDetails,
    InputTokensDetails,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from kvhive.server.sampling_fields import pick
from kvhive.server.structured import text_format
from kvhive.server.text_deltas import TextDelta
from kvhive.server.tools import NO_PLAN, ToolPlan
from kvhive.sessions.registry import Session, SessionNotDurable
from kvhive.sessions.response_store import StoredResponse

if TYPE_CHECKING:
    from kvhive.server.responses import ResponsesAPI

logger = logging.getLogger(__name__)


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
