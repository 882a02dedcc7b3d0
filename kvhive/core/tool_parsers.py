"""Tool calls read out of a model's output text as it streams, per model family (torch-free).

A parser is fed the output text in pieces of any size and answers events: content text, a call
started (its name known), a piece of a call's arguments. Fed the whole text at once it answers the
same calls and content as fed in any chunking, because both run the one character-level scanner.
Every character is looked at a bounded number of times, so a parser is linear in the output.

Formats (``docs/tool_calling.md``):

- ``hermes`` (Qwen2.5, Qwen3, and kvhive's format for templates without tool support):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, text before them.
- ``llama3_json`` (Llama 3.x): the output is ``{"name": ..., "parameters": {...}}`` (after an optional
  ``<|python_tag|>``), calls separated by ``;``; an output that starts otherwise is content.
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` after any text, or such an
  array opening the output (a special-token marker does not show in the decoded text).

A call's ``arguments`` are the JSON text the model wrote for them (an arguments value written as a
JSON string is unquoted); ``{}`` when it wrote none. A call is reported once its name is read; a
call object that ends without a string ``name`` goes back to the content, markup and all.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Literal

ParserName = Literal["hermes", "llama3_json", "mistral"]
PARSER_NAMES: tuple[ParserName, ...] = ("hermes", "llama3_json", "mistral")

HERMES_BEGIN, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_BEGIN = "[TOOL_CALLS]"
_WHITESPACE = " \t\r\n"


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


class _CallObject:
    """Scans one JSON object char by char: its top-level keys, the string ``name`` and the raw text of
    the arguments value. ``done`` once its closing brace is read."""

    def __init__(self, args_keys: tuple[str, ...]) -> None:
        self._args_keys = args_keys
        self.chars: list[str] = []
        self.done = False
        self.name: str | None = None
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._string_start = -1          # where the last string at depth 1 began
        self._last_string: str | None = None
        self._key: str | None = None     # the key whose value is being read
        self._value_start = -1           # -1: no value started yet
        self._value_end = -1             # after the value's last significant character
        self._args: tuple[int, int] | None = None   # the arguments value's span once closed
        self._args_open = False

    def feed(self, char: str) -> None:
        """One more character of the object."""
        position = len(self.chars)
        self.chars.append(char)
        if self._in_string:
            self._string_char(char, position)
        elif char in _WHITESPACE:
            return
        elif self._depth == 1 and char in ",}":
            self._close_value()
            if char == "}":
                self._depth, self.done = 0, True
        elif self._depth == 1 and char == ":" and self._value_start < 0:
            self._key, self._last_string = self._last_string, None
        else:
            self._structural_char(char, position)

    def _string_char(self, char: str, position: int) -> None:
        if self._value_start >= 0:
            self._value_end = position + 1
        if self._escape:
            self._escape = False
        elif char == "\\":
            self._escape = True
        elif char == '"':
            self._in_string = False
            if self._depth == 1 and self._key is None:
                self._last_string = _json_string("".join(self.chars[self._string_start:position + 1]))

    def _structural_char(self, char: str, position: int) -> None:
        if self._depth == 1 and self._key is not None and self._value_start < 0:
            self._value_start = position
            self._args_open = self._key in self._args_keys
        if self._depth >= 1 and self._value_start >= 0:
            self._value_end = position + 1
        if char == '"':
            self._in_string = True
            if self._depth == 1 and self._key is None:
                self._string_start = position
        elif char in "{[":
            self._depth += 1
        elif char in "}]":
            self._depth -= 1

    def _close_value(self) -> None:
        if self._key is not None and self._value_start >= 0:
            if self._key == "name" and self.name is None:
                self.name = _json_string("".join(self.chars[self._value_start:self._value_end]))
            if self._args_open and self._args is None:
                self._args = (self._value_start, self._value_end)
        self._key, self._value_start, self._value_end, self._args_open = None, -1, -1, False

    def arguments_span(self) -> tuple[int, int] | None:
        """Where the arguments value is in ``chars`` as far as it is read (None before it starts)."""
        if self._args is not None:
            return self._args
        return (self._value_start, self._value_end) if self._args_open else None

    def arguments_are_streamed(self) -> bool:
        """Whether the arguments value is an object or array (its text only grows as it is read)."""
        span = self.arguments_span()
        return span is not None and self.chars[span[0]] in "{["

    def final_arguments(self) -> str:
        """The arguments text of the whole call: a JSON string value unquoted, ``{}`` when absent."""
        span = self.arguments_span()
        if span is None:
            return "{}"
        text = "".join(self.chars[span[0]:span[1]])
        as_string = None if self.arguments_are_streamed() else _json_string(text)
        return text if as_string is None else as_string


def _json_string(text: str) -> str | None:
    """``text`` as a JSON string's value, None when it is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


class ToolCallParser(ABC):
    """The shared machinery: content with held-back marker prefixes, call objects, events."""

    args_keys: tuple[str, ...] = ("arguments", "parameters")

    def __init__(self) -> None:
        self._events: list[ParseEvent] = []
        self._held = ""                  # content not sent yet: a possible marker start, or whitespace
        self._call: _CallObject | None = None
        self._call_prefix = ""           # the markup before the current call object
        self._sent_args = 0              # arguments characters of the current call sent
        self.num_calls = 0

    # ---- what subclasses call

    def _content(self, text: str) -> None:
        """Content text; trailing whitespace is held until more content follows (dropped before a
        call, and at the end when the output made calls)."""
        text = self._held + text
        kept = text.rstrip(_WHITESPACE)
        self._held = text[len(kept):]
        if kept:
            self._events.append(ContentDelta(kept))

    def _open_call(self, prefix: str) -> None:
        # Whitespace held before a call is markup, unless the call turns out not to be one.
        self._call, self._call_prefix, self._sent_args = _CallObject(self.args_keys), self._held + prefix, 0
        self._held = ""

    def _feed_call(self, char: str) -> bool:
        """One character of the current call; True once the call object is complete."""
        call = self._call
        assert call is not None
        started = call.name is not None
        call.feed(char)
        if call.name is not None and not started:
            self._events.append(CallStarted(self.num_calls, call.name))
        if call.name is not None and call.arguments_are_streamed():
            self._send_arguments()
        if call.done:
            self._end_call()
            return True
        return False

    def _send_arguments(self) -> None:
        """The arguments characters of an object or array value read since the last send."""
        call = self._call
        assert call is not None
        span = call.arguments_span()
        assert span is not None
        start, end = span[0] + self._sent_args, span[1]
        if end > start:
            self._events.append(ArgumentsDelta(self.num_calls, "".join(call.chars[start:end])))
            self._sent_args = end - span[0]

    def _send_final_arguments(self) -> None:
        """At the call's end: the arguments still unsent (all of them when they are not streamed)."""
        call = self._call
        assert call is not None
        if call.arguments_are_streamed():
            self._send_arguments()
        elif self._sent_args == 0:
            self._events.append(ArgumentsDelta(self.num_calls, call.final_arguments()))

    def _end_call(self) -> None:
        call = self._call
        assert call is not None
        if call.name is None:
            self._content(self._call_prefix + "".join(call.chars))
        else:
            self._send_final_arguments()
            self.num_calls += 1
        self._call = None

    # ---- the interface

    def feed(self, text: str) -> list[ParseEvent]:
        """The events that ``text`` (the next piece of the output) completes."""
        self._scan(text)
        events, self._events = _merged(self._events), []
        return events

    def finish(self) -> list[ParseEvent]:
        """The events still held at the end of the output (an unfinished call's markup goes to the
        content when its name was never read; held whitespace goes only when no call was made)."""
        self._flush()
        if self._call is not None:
            self._end_call()
        if self._held and self.num_calls == 0:
            self._events.append(ContentDelta(self._held))
        self._held = ""
        events, self._events = _merged(self._events), []
        return events

    @abstractmethod
    def _scan(self, text: str) -> None:
        """Read the next piece of the output (each family its own framing)."""

    @abstractmethod
    def _flush(self) -> None:
        """At the end: content text still held goes out (markup cut off by the end is dropped)."""


class _MarkerParser(ToolCallParser):
    """Content up to ``begin``; then call objects until the framing ends (``_after_call``)."""

    begin = ""

    def __init__(self) -> None:
        super().__init__()
        self._state = "content"          # content | before_call | call | after_call
        self._pending = ""               # content that may be the start of the marker
        self._framing = ""               # the markup read around the current call

    def _scan(self, text: str) -> None:
        index = 0
        while index < len(text):
            if self._state == "content":
                index = self._scan_content(text, index)
            elif self._state == "call":
                if self._feed_call(text[index]):
                    self._state = "after_call"
                index += 1
            else:
                self._framing_char(text[index])
                index += 1

    def _scan_content(self, text: str, index: int) -> int:
        """Content from ``index`` up to the next ``begin`` marker (a possible marker start held)."""
        pending = self._pending + text[index:]
        found = pending.find(self.begin)
        if found >= 0:
            self._content(pending[:found])
            self._pending = ""
            self._state = "before_call"
            self._framing = self.begin
            return len(text) - (len(pending) - found - len(self.begin))
        keep = _marker_prefix_length(pending, self.begin)
        self._content(pending[:len(pending) - keep])
        self._pending = pending[len(pending) - keep:]
        return len(text)

    @abstractmethod
    def _framing_char(self, char: str) -> None:
        """One character of the markup around calls."""

    def _back_to_content(self, text: str) -> None:
        self._state = "content"
        if text:
            self._content(text)

    def _flush(self) -> None:
        # Markup cut off by the end of the output (a marker without its call) is dropped.
        if self._state == "content":
            self._content(self._pending)
        self._pending = ""


class HermesParser(_MarkerParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, text before and between."""

    begin = HERMES_BEGIN

    def _framing_char(self, char: str) -> None:
        self._framing += char
        if self._state == "before_call":
            if char == "{":
                self._open_call(self._framing[:-1])
                self._state = "call"
                self._feed_call(char)
            elif char not in _WHITESPACE:
                self._back_to_content(self._framing)
            return
        body = self._framing.lstrip(_WHITESPACE)
        if body == HERMES_END:
            self._framing = ""
            self._back_to_content("")
        elif not HERMES_END.startswith(body):
            self._back_to_content(body)

    def _open_call(self, prefix: str) -> None:
        super()._open_call(prefix)
        self._framing = ""


class MistralParser(_MarkerParser):
    """``[TOOL_CALLS][{...}, {...}]`` (or one bare object after the marker). An output that starts
    with an array of objects is read as calls too: where ``[TOOL_CALLS]`` is a special token, the
    text the tokenizer decodes has no marker."""

    begin = MISTRAL_BEGIN

    def __init__(self) -> None:
        super().__init__()
        self._in_array = False
        self._start: str | None = ""     # the output's first characters until they decide; then None

    def _scan(self, text: str) -> None:
        if self._start is not None:
            text = self._scan_start(text)
        if text:
            super()._scan(text)

    def _scan_start(self, text: str) -> str:
        """The output's start: ``[`` then ``{`` opens the calls' array; anything else is content.
        Returns the text left to scan."""
        assert self._start is not None
        for index, char in enumerate(text):
            self._start += char
            body = self._start.lstrip(_WHITESPACE)
            rest = body[1:].lstrip(_WHITESPACE) if body.startswith("[") else body
            if not rest:
                continue
            held, self._start = self._start, None
            if body.startswith("[") and rest == "{":
                self._state, self._in_array, self._framing = "before_call", True, held[:-1]
                return text[index:]
            return held[:-1] + text[index:]       # content (which may still hold the marker)
        return ""

    def _flush(self) -> None:
        if self._start:
            self._content(self._start)
        super()._flush()

    def _end_call(self) -> None:
        if self._call is not None and self._call.name is None:
            self._in_array = False       # not calls: the rest of the array is content too
        super()._end_call()

    def _framing_char(self, char: str) -> None:
        self._framing += char
        if char in _WHITESPACE:
            return
        if char == "{":
            prefix = self._framing[:-1]
            self._open_call(prefix)
            self._framing = ""
            self._state = "call"
            self._feed_call(char)
        elif char == "[" and self._state == "before_call" and not self._in_array:
            self._in_array = True
        elif char == "," and self._state == "after_call" and self._in_array:
            self._state = "before_call"
        elif char == "]" and self._in_array:
            self._in_array = False
            self._framing = ""
            self._back_to_content("")
        else:
            text = self._framing
            self._in_array, self._framing = False, ""
            self._back_to_content(text)


class Llama3JsonParser(ToolCallParser):
    """An output that is ``{"name": ..., "parameters": {...}}`` calls (after an optional
    ``<|python_tag|>``) separated by ``;``; any other output is content."""

    def __init__(self) -> None:
        super().__init__()
        self._state = "start"            # start | call | between | content
        self._start = ""                 # the output's start, held until it decides

    def _scan(self, text: str) -> None:
        for index, char in enumerate(text):
            if self._state == "content":
                self._content(text[index:])
                return
            if self._state == "call":
                if self._feed_call(char):
                    self._state, self._start = "between", ""
            else:
                self._framing_char(char)

    def _framing_char(self, char: str) -> None:
        self._start += char
        body = self._start.lstrip(_WHITESPACE)
        if self._state == "start" and body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].lstrip(_WHITESPACE)
        if self._state == "between":
            body = body.lstrip(_WHITESPACE + ";")
        if body == "" or (self._state == "start" and PYTHON_TAG.startswith(body)):
            return
        if body == "{":
            self._open_call(self._start[:-1])
            self._state = "call"
            self._feed_call(char)
            return
        self._state = "content"
        self._content(self._start if self.num_calls == 0 else body)

    def _flush(self) -> None:
        if self._state == "start" and self._start:
            self._content(self._start)


def _merged(events: list[ParseEvent]) -> list[ParseEvent]:
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


def _marker_prefix_length(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``marker``."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


_PARSERS: dict[ParserName, type[ToolCallParser]] = {
    "hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser}


def new_parser(name: ParserName) -> ToolCallParser:
    """A fresh streaming parser of the named format."""
    return _PARSERS[name]()


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


def parse_whole(name: ParserName, text: str) -> ParsedOutput:
    """A whole output's content and calls."""
    parser = new_parser(name)
    return collect(parser.feed(text) + parser.finish())
