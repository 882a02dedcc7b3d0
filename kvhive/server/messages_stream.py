"""The answer of ``POST /v1/messages``, whole or streamed: the output read into text and
``tool_use`` blocks (``ToolOutputReader``), Anthropic's stop reasons, its usage counters, and the
stream's events (``message_start``, ``ping``, ``content_block_start`` / ``content_block_delta``
with ``text_delta`` or ``input_json_delta`` / ``content_block_stop``, ``message_delta`` with the
stop reason and the usage, ``message_stop``; ``error`` when the request fails after the headers).

Stop sequences run with the stop string kept in the text (``include_stop_str_in_output``): the
last delta of a request a stop sequence ended ends with it, so the answer names the sequence
(``stop_sequence``) and cuts it from the text.
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvhive.core.anthropic_errors import anthropic_error_body
from kvhive.core.tool_parsers import ContentDelta
from kvhive.engine.request_errors import ConstraintRefused
from kvhive.server.errors import APIError, constraint_error, session_error
from kvhive.server.messages_protocol import MessagesResponse, MessagesUsage, TextBlock, ToolUseBlock
from kvhive.server.prompt_cache import PromptCache
from kvhive.server.sse import sse_named_event
from kvhive.server.text_deltas import TextDelta
from kvhive.server.tool_output import CallBegun, OutputCall, OutputEvent, ToolOutputReader, read_whole
from kvhive.server.tools import ToolPlan
from kvhive.sessions.errors import SessionError

logger = logging.getLogger(__name__)


def new_message_id() -> str:
    """A fresh message id (also the engine request id)."""
    return f"msg_{uuid.uuid4().hex}"


def tool_use_id(call: OutputCall) -> str:
    """A call's id in Anthropic's form (``toolu_...``)."""
    return f"toolu_{call.id.removeprefix('call_')}"


def call_input(call: OutputCall) -> dict[str, Any] | None:
    """A call's arguments as the object ``tool_use.input`` holds; None when they are not one."""
    try:
        value = json.loads(call.arguments_text or "{}")
    except (ValueError, RecursionError):            # RecursionError: nested past the parser's stack
        return None
    return value if isinstance(value, dict) else None


def cut_stop_sequence(text: str, stop_sequences: Sequence[str]) -> tuple[str, str | None]:
    """The last delta's text without the stop sequence it ends with, and that sequence (the
    longest one it ends with: the stop matcher ends the text at the earliest match)."""
    matched = max((s for s in stop_sequences if s and text.endswith(s)), key=len, default=None)
    return (text, None) if matched is None else (text[:-len(matched)], matched)


def stop_reason(engine_reason: str, matched: str | None, made_calls: bool) -> str:
    """Anthropic's stop reason of an output that ended for ``engine_reason``."""
    if engine_reason == "length":
        return "max_tokens"
    if matched is not None:
        return "stop_sequence"
    return "tool_use" if made_calls else "end_turn"


@dataclass(frozen=True)
class MessageAnswer:
    """What one Messages request answers: its content blocks, stop reason and usage."""

    model: str
    plan: ToolPlan
    num_prompt_tokens: int
    stop_sequences: tuple[str, ...]
    cache: PromptCache
    message_id: str = field(default_factory=new_message_id)

    def usage(self, final: TextDelta | None) -> MessagesUsage:
        """The counters: the pins' split of the prompt (``PinTurn.cache_usage``) when the request
        carried breakpoints; without any, the whole prompt is input, as Anthropic counts it."""
        output = 0 if final is None else final.num_output_tokens
        pinned = None if self.cache.pins is None else self.cache.pins.usage
        if pinned is None:
            return MessagesUsage(input_tokens=self.num_prompt_tokens, output_tokens=output)
        return MessagesUsage(input_tokens=pinned.input_tokens, output_tokens=output,
                             cache_creation_input_tokens=pinned.cache_creation_input_tokens,
                             cache_read_input_tokens=pinned.cache_read_input_tokens)

    def response(self, result: TextDelta) -> MessagesResponse:
        """The whole answer: text and tool_use blocks in the order they came; a call whose
        arguments are not a JSON object stays text."""
        text, matched = cut_stop_sequence(result.text, self.stop_sequences)
        read = read_whole(self.plan, text)
        calls: list[TextBlock | ToolUseBlock] = []
        for call in read.calls:
            value = call_input(call)
            calls.append(TextBlock(text=f"{call.name}: {call.arguments_text}") if value is None
                         else ToolUseBlock(id=tool_use_id(call), name=call.name, input=value))
        content: list[TextBlock | ToolUseBlock] = [TextBlock(text=read.content)] if read.content else []
        blocks = content + calls if read.content_first or not calls else calls + content
        made_calls = any(isinstance(b, ToolUseBlock) for b in blocks)
        return MessagesResponse(id=self.message_id, model=self.model, content=blocks,
                                stop_reason=stop_reason(result.finish_reason or "stop", matched, made_calls),
                                stop_sequence=matched, usage=self.usage(result))

    async def events(self, stream: AsyncIterator[TextDelta]) -> AsyncIterator[str]:
        """The SSE events of the answer; a failure after the headers is an ``error`` event."""
        yield sse_named_event("message_start", {"type": "message_start", "message": {
            "id": self.message_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": MessagesUsage(input_tokens=self.num_prompt_tokens, output_tokens=0).model_dump()}})
        yield sse_named_event("ping", {"type": "ping"})
        try:
            async with contextlib.aclosing(stream) as deltas:
                async for event in self._content_events(deltas):
                    yield event
        except (APIError, SessionError, ConstraintRefused) as exc:
            error = (exc if isinstance(exc, APIError) else session_error(exc) if isinstance(exc, SessionError)
                     else constraint_error(exc))
            yield sse_named_event("error", anthropic_error_body(error.status_code, error.message))
        except Exception as exc:  # noqa: BLE001 - reported to the client in the stream
            logger.exception("engine error while streaming a message")
            yield sse_named_event("error", anthropic_error_body(500, f"Engine error: {type(exc).__name__}: {exc}"))

    async def _content_events(self, deltas: AsyncIterator[TextDelta]) -> AsyncIterator[str]:
        reader = ToolOutputReader(self.plan)
        blocks = BlockEvents()
        async for delta in deltas:
            text, matched = delta.text, None
            if delta.finish_reason is not None:
                text, matched = cut_stop_sequence(text, self.stop_sequences)
            for event in blocks.events(reader.feed(text) if text else []):
                yield event
            if delta.finish_reason is None:
                continue
            for event in [*blocks.events(reader.finish()), *blocks.close()]:
                yield event
            usage = self.usage(delta).model_dump()
            reason = stop_reason(delta.finish_reason, matched, bool(reader.calls))
            yield sse_named_event("message_delta", {"type": "message_delta", "usage": usage, "delta": {
                "stop_reason": reason, "stop_sequence": matched}})
            yield sse_named_event("message_stop", {"type": "message_stop"})
            return


class BlockEvents:
    """The content block events of read output: a text block opens on text, a tool_use block on a
    call, each closing the block before it."""

    def __init__(self) -> None:
        self.index = -1                     # the latest block's index (-1: none yet)
        self.open = False                   # whether that block is open (no stop event yet)
        self._kind = ""                     # its type: "text" or "tool_use"

    def events(self, events: list[OutputEvent]) -> list[str]:
        """The SSE events of these read events."""
        out: list[str] = []
        for event in events:
            if isinstance(event, ContentDelta):
                if not event.text:
                    continue
                if not (self.open and self._kind == "text"):
                    out += self._start({"type": "text", "text": ""}, "text")
                out.append(self._delta({"type": "text_delta", "text": event.text}))
            elif isinstance(event, CallBegun):
                out += self._start({"type": "tool_use", "id": tool_use_id(event.call), "name": event.call.name,
                                    "input": {}}, "tool_use")
            elif event.text:
                out.append(self._delta({"type": "input_json_delta", "partial_json": event.text}))
        return out

    def close(self) -> list[str]:
        """The open block's stop event (none when no block is open)."""
        if not self.open:
            return []
        self.open = False
        return [sse_named_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _start(self, block: dict[str, Any], kind: str) -> list[str]:
        out = self.close()
        self.index += 1
        self.open, self._kind = True, kind
        out.append(sse_named_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                           "content_block": block}))
        return out

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse_named_event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                       "delta": delta})
