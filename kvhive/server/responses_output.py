"""A response's output items as its text streams: the assistant message and the function calls read
from the text (``ToolOutputReader``), each opened by ``response.output_item.added`` when it first
appears and closed, in output order, when the output ends.

Without tools (or with ``tool_choice`` "none") the output is one message, opened before any text.
With tools the message is opened at the first content text, so an output that only calls
functions has only ``function_call`` items. Items keep the order they were opened in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from kvhive.core.tool_parsers import ArgumentsDelta, ContentDelta
from kvhive.server.logprobs import SentToken
from kvhive.server.responses_items import new_item_id
from kvhive.server.responses_protocol import FunctionCallItem, OutputMessage, OutputText
from kvhive.server.tool_output import CallBegun, OutputCall, OutputEvent, ToolOutputReader
from kvhive.server.tools import ToolPlan

Status = Literal["in_progress", "completed", "incomplete"]
# One stream event before it is framed: its type and its fields.
Event = tuple[str, dict[str, Any]]


@dataclass
class OutputItems:
    """The output items of one response as its text is read; ``logprobs`` turns sent tokens into
    the ``output_text`` logprobs shape."""

    plan: ToolPlan
    logprobs: Callable[[tuple[SentToken, ...]], list[Any]]
    message_id: str = field(default_factory=new_item_id)
    reader: ToolOutputReader = field(init=False)
    # What each output index holds: "message", or a call's index among the calls.
    order: list[str | int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    tokens: list[SentToken] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reader = ToolOutputReader(self.plan)

    # ------------------------------------------------------------ streaming

    def start(self) -> list[Event]:
        """The events before any text: the message opened, when the output cannot make calls."""
        return [] if self.plan.parses_calls else self._open_message()

    def add(self, text: str, tokens: tuple[SentToken, ...], with_logprobs: bool) -> list[Event]:
        """The events of the next piece of text (and its tokens)."""
        self.tokens.extend(tokens)
        events = self._events(self.reader.feed(text) if text else [], tokens)
        if not events and with_logprobs and tokens and "message" in self.order:
            # A token without text of its own (the end-of-turn token) still has logprobs to send.
            events.append(self._text_delta("", tokens))
        return events

    def finish(self) -> list[Event]:
        """The events of what the reader still held at the end of the text (and the message, empty,
        when the output held nothing at all)."""
        events = self._events(self.reader.finish(), ())
        return events if self.order else self._open_message()

    def _events(self, read: list[OutputEvent], tokens: tuple[SentToken, ...]) -> list[Event]:
        events: list[Event] = []
        for item in read:
            if isinstance(item, ContentDelta):
                if "message" not in self.order:
                    events += self._open_message()
                self.text.append(item.text)
                events.append(self._text_delta(item.text, tokens))
                tokens = ()
            elif isinstance(item, CallBegun):
                self.order.append(item.index)
                events.append(("response.output_item.added", {
                    "output_index": len(self.order) - 1, "item": self._call_item(item.call, "in_progress", "")}))
            elif isinstance(item, ArgumentsDelta):
                call = self.reader.calls[item.index]
                events.append(("response.function_call_arguments.delta", {
                    "item_id": self._item_id(call), "output_index": self.order.index(item.index),
                    "delta": item.text}))
        return events

    def _open_message(self) -> list[Event]:
        self.order.append("message")
        index = len(self.order) - 1
        return [("response.output_item.added", {"output_index": index, "item": self.message("in_progress", None)}),
                ("response.content_part.added", {"item_id": self.message_id, "output_index": index,
                                                 "content_index": 0, "part": OutputText(text="")})]

    def _text_delta(self, text: str, tokens: tuple[SentToken, ...]) -> Event:
        return ("response.output_text.delta", {"item_id": self.message_id, "output_index": self.order.index("message"),
                                               "content_index": 0, "delta": text, "logprobs": self.logprobs(tokens)})

    # ------------------------------------------------------------ the whole output

    def read_whole(self, text: str) -> None:
        """Read a whole output at once (a response that is not streamed)."""
        self.reader.feed(text)
        self.reader.finish()
        content = self.reader.content
        self.text = [content or ""]
        self.order = list(range(len(self.reader.calls)))
        if content is not None:
            self.order.insert(0 if self.reader.content_first or not self.order else len(self.order), "message")

    def output(self, status: Status) -> list[OutputMessage | FunctionCallItem]:
        """The output items in order; a response that read nothing at all still has its message."""
        if not self.order:
            self.order.append("message")
        items: list[OutputMessage | FunctionCallItem] = []
        for key in self.order:
            if key == "message":
                items.append(self.message(status, "".join(self.text), tuple(self.tokens)))
            else:
                items.append(self._call_item(self.reader.calls[key], status, None))
        return items

    def done_events(self, output: list[dict[str, Any]]) -> list[Event]:
        """The events that close each item of the final ``output`` (dumped items), in order."""
        events: list[Event] = []
        for index, item in enumerate(output):
            if item["type"] == "message":
                ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
                part = item["content"][0]
                events += [("response.output_text.done", {**ids, "text": part["text"], "logprobs": part["logprobs"]}),
                           ("response.content_part.done", {**ids, "part": part})]
            else:
                events.append(("response.function_call_arguments.done", {
                    "item_id": item["id"], "output_index": index, "name": item["name"],
                    "arguments": item["arguments"]}))
            events.append(("response.output_item.done", {"output_index": index, "item": item}))
        return events

    # ------------------------------------------------------------ items

    def message(self, status: Status, text: str | None, tokens: tuple[SentToken, ...] = ()) -> OutputMessage:
        """The output message, with its text part (and its tokens' logprobs) once there is one."""
        content = [] if text is None else [OutputText(text=text, logprobs=self.logprobs(tokens))]
        return OutputMessage(id=self.message_id, status=status, content=content)

    @staticmethod
    def _item_id(call: OutputCall) -> str:
        return "fc_" + call.id.removeprefix("call_")

    def _call_item(self, call: OutputCall, status: Status, arguments: str | None) -> FunctionCallItem:
        return FunctionCallItem(id=self._item_id(call), call_id=call.id, name=call.name,
                                arguments=call.arguments_text if arguments is None else arguments, status=status)
