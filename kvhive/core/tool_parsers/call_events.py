"""What a tool-call parser answers: content text, a call begun, a piece of a call's arguments; and
events joined into whole calls."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

ParserName = Literal["hermes", "llama3_json", "mistral"]
PARSER_NAMES: tuple[ParserName, ...] = ("hermes", "llama3_json", "mistral")

HERMES_BEGIN, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_BEGIN = "[TOOL_CALLS]"
WHITESPACE = " \t\r\n"


@dataclass(frozen=True)
class ContentDelta:
    """Text of the assistant's message (not part of any call)."""

    text: str


@dataclass(frozen=True)
class CallStarted:
    """Call ``index`` (0, 1, ... in output order) has begun; its function's name."""

    index: int
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    """More of call ``index``'s arguments text."""

    index: int
    text: str


ParseEvent = ContentDelta | CallStarted | ArgumentsDelta


@dataclass(frozen=True)
class ParsedCall:
    """One whole call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass
class ParsedOutput:
    """A whole output split into content and calls (``collect``)."""

    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


def merged_events(events: list[ParseEvent]) -> list[ParseEvent]:
    """Adjacent content deltas, and adjacent argument deltas of one call, joined (in linear time)."""
    merged: list[ParseEvent] = []
    run: list[str] = []                  # the texts of the run of deltas like merged[-1]
    for event in events:
        last = merged[-1] if merged else None
        same = (isinstance(event, ContentDelta) and isinstance(last, ContentDelta)) or (
            isinstance(event, ArgumentsDelta) and isinstance(last, ArgumentsDelta) and last.index == event.index)
        if same:
            run.append(event.text)
            continue
        _close_run(merged, run)
        merged.append(event)
        run = [event.text] if not isinstance(event, CallStarted) else []
    _close_run(merged, run)
    return merged


def _close_run(merged: list[ParseEvent], run: list[str]) -> None:
    if len(run) > 1:
        last = merged[-1]
        merged[-1] = ContentDelta("".join(run)) if isinstance(last, ContentDelta) else ArgumentsDelta(
            last.index, "".join(run))


def collect(events: list[ParseEvent], into: ParsedOutput | None = None) -> ParsedOutput:
    """Events joined into content and whole calls."""
    out = into or ParsedOutput()
    names: dict[int, str] = {c: call.name for c, call in enumerate(out.calls)}
    args: dict[int, list[str]] = {c: [call.arguments] for c, call in enumerate(out.calls)}
    parts = [out.content]
    for event in events:
        if isinstance(event, ContentDelta):
            parts.append(event.text)
        elif isinstance(event, CallStarted):
            names[event.index], args[event.index] = event.name, []
        else:
            args[event.index].append(event.text)
    out.content = "".join(parts)
    out.calls = [ParsedCall(names[i], "".join(args[i])) for i in sorted(names)]
    return out
