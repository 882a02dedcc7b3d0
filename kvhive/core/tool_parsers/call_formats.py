"""The parsers of each family's call format: Hermes, Mistral and Llama 3 JSON."""

from __future__ import annotations

from abc import abstractmethod

from kvhive.core.tool_parsers.base import ToolCallParser, marker_prefix_length
from kvhive.core.tool_parsers.call_events import (
    HERMES_BEGIN,
    HERMES_END,
    MISTRAL_BEGIN,
    PYTHON_TAG,
    WHITESPACE,
    ParsedOutput,
    ParserName,
    collect,
)


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
        keep = marker_prefix_length(pending, self.begin)
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
            elif char not in WHITESPACE:
                self._back_to_content(self._framing)
            return
        body = self._framing.lstrip(WHITESPACE)
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
            body = self._start.lstrip(WHITESPACE)
            rest = body[1:].lstrip(WHITESPACE) if body.startswith("[") else body
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
        if char in WHITESPACE:
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
        body = self._start.lstrip(WHITESPACE)
        if self._state == "start" and body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].lstrip(WHITESPACE)
        if self._state == "between":
            body = body.lstrip(WHITESPACE + ";")
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


_PARSERS: dict[ParserName, type[ToolCallParser]] = {
    "hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser}


def new_parser(name: ParserName) -> ToolCallParser:
    """A fresh streaming parser of the named format."""
    return _PARSERS[name]()


def parse_whole(name: ParserName, text: str) -> ParsedOutput:
    """A whole output's content and calls."""
    parser = new_parser(name)
    return collect(parser.feed(text) + parser.finish())
