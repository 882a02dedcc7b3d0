"""One JSON call object read a character at a time: its ``name`` and the raw text of its arguments
value, known as soon as they are read."""

from __future__ import annotations

import json

from kvhive.core.tool_parsers.call_events import WHITESPACE


class CallObject:
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
        elif char in WHITESPACE:
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
