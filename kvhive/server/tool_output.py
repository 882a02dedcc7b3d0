"""One choice's output read for tool calls (``ToolPlan.parses_calls``): its text split into content
and calls as it streams, calls numbered and given fresh ids, at most ``ToolPlan.max_calls`` of them.
Chat completions and the Responses API shape what this reads into their own messages and events.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from kvhive.core.tool_parsers import ArgumentsDelta, CallStarted, ContentDelta, ParseEvent, new_parser
from kvhive.server.tools import ToolPlan


def new_call_id() -> str:
    """A fresh tool call id."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class OutputCall:
    """A call as read so far: its id, function name and arguments text."""

    id: str
    name: str
    arguments: list[str] = field(default_factory=list)

    @property
    def arguments_text(self) -> str:
        """The arguments read so far."""
        return "".join(self.arguments)


@dataclass(frozen=True)
class CallBegun:
    """A call's first event: its index, id and name."""

    index: int
    call: OutputCall


# Content, a call begun, or more of a call's arguments (the parser's event, its index the same).
OutputEvent = ContentDelta | CallBegun | ArgumentsDelta


class ToolOutputReader:
    """Reads one choice's output text into content and calls (a choice whose plan parses no calls
    passes its text through as content)."""

    def __init__(self, plan: ToolPlan) -> None:
        self._parser = new_parser(plan.parser) if plan.parses_calls else None
        self._max_calls = plan.max_calls
        self.calls: list[OutputCall] = []
        self._content: list[str] = []
        self.content_first = False               # whether content came before the first call

    def feed(self, text: str) -> list[OutputEvent]:
        """The events ``text`` (the next piece of the choice's output) completes."""
        if self._parser is None:
            return self._record([ContentDelta(text)] if text else [])
        return self._record(self._parser.feed(text))

    def finish(self) -> list[OutputEvent]:
        """The events still held at the end of the output."""
        return [] if self._parser is None else self._record(self._parser.finish())

    @property
    def content(self) -> str | None:
        """The content read (None when the output made calls and wrote no other text)."""
        text = "".join(self._content)
        return None if self.calls and not text else text

    def finish_reason(self, engine_reason: str) -> str:
        """``tool_calls`` when the output ended by itself after making calls, else the engine's."""
        return "tool_calls" if self.calls and engine_reason == "stop" else engine_reason

    def _record(self, events: list[ParseEvent]) -> list[OutputEvent]:
        out: list[OutputEvent] = []
        for event in events:
            if isinstance(event, ContentDelta):
                self.content_first = self.content_first or not self.calls
                self._content.append(event.text)
                out.append(event)
            elif self._max_calls is not None and event.index >= self._max_calls:
                continue                     # beyond parallel_tool_calls' one call
            elif isinstance(event, CallStarted):
                call = OutputCall(new_call_id(), event.name)
                self.calls.append(call)
                out.append(CallBegun(event.index, call))
            elif isinstance(event, ArgumentsDelta):
                self.calls[event.index].arguments.append(event.text)
                out.append(event)
        return out


def read_whole(plan: ToolPlan, text: str) -> ToolOutputReader:
    """A whole output read."""
    reader = ToolOutputReader(plan)
    reader.feed(text)
    reader.finish()
    return reader
