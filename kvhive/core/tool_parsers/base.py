"""What every family's parser shares: content with held-back whitespace and marker starts, the call
object being read, and the events it turns into."""

from __future__ import annotations

from abc import ABC, abstractmethod

from kvhive.core.tool_parsers.call_events import (
    WHITESPACE,
    ArgumentsDelta,
    CallStarted,
    ContentDelta,
    ParseEvent,
    merged_events,
)
from kvhive.core.tool_parsers.call_object import CallObject


class ToolCallParser(ABC):
    """The shared machinery: content with held-back marker prefixes, call objects, events."""

    args_keys: tuple[str, ...] = ("arguments", "parameters")

    def __init__(self) -> None:
        self._events: list[ParseEvent] = []
        self._held = ""                  # content not sent yet: a possible marker start, or whitespace
        self._call: CallObject | None = None
        self._call_prefix = ""           # the markup before the current call object
        self._sent_args = 0              # arguments characters of the current call sent
        self.num_calls = 0

    # ---- what subclasses call

    def _content(self, text: str) -> None:
        """Content text; trailing whitespace is held until more content follows (dropped before a
        call, and at the end when the output made calls)."""
        text = self._held + text
        kept = text.rstrip(WHITESPACE)
        self._held = text[len(kept):]
        if kept:
            self._events.append(ContentDelta(kept))

    def _open_call(self, prefix: str) -> None:
        # Whitespace held before a call is markup, unless the call turns out not to be one.
        self._call, self._call_prefix, self._sent_args = CallObject(self.args_keys), self._held + prefix, 0
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
        events, self._events = merged_events(self._events), []
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
        events, self._events = merged_events(self._events), []
        return events

    @abstractmethod
    def _scan(self, text: str) -> None:
        """Read the next piece of the output (each family its own framing)."""

    @abstractmethod
    def _flush(self) -> None:
        """At the end: content text still held goes out (markup cut off by the end is dropped)."""


def marker_prefix_length(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``marker``."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
