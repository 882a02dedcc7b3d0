"""The Responses API's items as they are stored: a request's input checked into message and function
call items, a conversation's items as chat messages, and each ``function_call_output`` checked
against the calls before it."""

from __future__ import annotations

import uuid
from typing import Any

from kvhive.core.json_body import load_json_text
from kvhive.core.request_fields import stray_field, stray_field_message
from kvhive.core.tokenize_bodies import MessageToolCall, ToolCallFunction
from kvhive.core.tool_definitions import MAX_CALL_ID_CHARS
from kvhive.server.chat_protocol import ChatMessage, ContentPart
from kvhive.server.errors import bad_request
from kvhive.server.responses_protocol import (
    INPUT_ROLES,
    OUTPUT_TEXT_FIELDS,
    TEXT_PART_TYPES,
    InputItem,
    InputPart,
    ResponsesRequest,
)


def new_item_id() -> str:
    """A fresh message item id."""
    return f"msg_{uuid.uuid4().hex}"


def message_item(role: str, texts: list[str]) -> dict[str, Any]:
    """A message item as it is stored and listed (assistant parts are output_text)."""
    if role == "assistant":
        content = [{"type": "output_text", "text": t, "annotations": []} for t in texts]
    else:
        content = [{"type": "input_text", "text": t} for t in texts]
    return {"id": new_item_id(), "type": "message", "role": role, "status": "completed", "content": content}


def function_call_item(call_id: str, name: str, arguments: str, item_id: str | None = None,
                       status: str = "completed") -> dict[str, Any]:
    """A function call item as it is stored, listed and answered."""
    return {"id": item_id or f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": status,
            "call_id": call_id, "name": name, "arguments": arguments}


def function_output_item(call_id: str, output: str) -> dict[str, Any]:
    """A function call output item as it is stored and listed."""
    return {"id": f"fco_{uuid.uuid4().hex}", "type": "function_call_output", "status": "completed",
            "call_id": call_id, "output": output}


def _call_item(item: InputItem, i: int) -> dict[str, Any]:
    """A ``function_call`` or ``function_call_output`` input item, its fields checked."""
    fields = ("call_id", "name", "arguments") if item.type == "function_call" else ("call_id", "output")
    for name in fields:
        if getattr(item, name) is None:
            raise bad_request(f"Missing required parameter 'input[{i}].{name}'", param=f"input[{i}].{name}")
    assert item.call_id is not None
    if not 0 < len(item.call_id) <= MAX_CALL_ID_CHARS:
        raise bad_request(f"'input[{i}].call_id' must be 1 to {MAX_CALL_ID_CHARS} characters", param=f"input[{i}].call_id")
    if item.type == "function_call":
        assert item.name is not None and item.arguments is not None
        return function_call_item(item.call_id, item.name, item.arguments)
    output = item.output if isinstance(item.output, str) else "\n".join(_part_texts(item.output or [], i, "output"))
    return function_output_item(item.call_id, output)


def _part_texts(parts: list[InputPart], i: int, field: str) -> list[str]:
    texts = []
    for j, part in enumerate(parts):
        if part.type not in TEXT_PART_TYPES or part.text is None:
            raise bad_request(f"Content parts of type '{part.type}' are not supported; only "
                              f"{' and '.join(TEXT_PART_TYPES)} with text", param=f"input[{i}].{field}[{j}].type")
        stray = stray_field(part, OUTPUT_TEXT_FIELDS)
        if stray is not None:
            raise bad_request(stray_field_message(stray, part.type), param=f"input[{i}].{field}[{j}].{stray}")
        texts.append(part.text)
    return texts


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as message and function call items (a string is one user message); 400
    for anything else."""
    if isinstance(body.input, str):
        return [message_item("user", [body.input])]
    if not body.input:
        raise bad_request("'input' must contain at least one item", param="input")
    items = []
    for i, item in enumerate(body.input):
        if item.type in ("function_call", "function_call_output"):
            items.append(_call_item(item, i))
            continue
        if item.type not in (None, "message"):
            raise bad_request(f"Input items of type '{item.type}' are not supported; only text messages, "
                              "function_call and function_call_output", param=f"input[{i}].type")
        if item.role not in INPUT_ROLES:
            raise bad_request(f"Invalid role {item.role!r}: expected one of {', '.join(INPUT_ROLES)}",
                              param=f"input[{i}].role")
        if item.content is None:
            raise bad_request(f"Missing required parameter 'input[{i}].content'", param=f"input[{i}].content")
        if isinstance(item.content, str):
            items.append(message_item(item.role, [item.content]))
            continue
        items.append(message_item(item.role, _part_texts(item.content, i, "content")))
    return items


def chat_messages(items: list[dict[str, Any]]) -> list[ChatMessage]:
    """Stored items (inputs, and outputs of earlier responses) as chat messages: function calls
    join the assistant message before them (or one of their own); a call's output is a ``tool``
    message."""
    messages: list[ChatMessage] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "function_call":
            call = MessageToolCall(id=item["call_id"], function=ToolCallFunction(name=item["name"],
                                                                                 arguments=item["arguments"]))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif kind == "function_call_output":
            messages.append(ChatMessage(role="tool", tool_call_id=item["call_id"], content=item["output"]))
        else:
            parts = [ContentPart(type="text", text=part["text"]) for part in item["content"]]
            messages.append(ChatMessage(role=item["role"], content=parts))
    return messages


def check_call_ids(history: list[dict[str, Any]], items: list[dict[str, Any]]) -> None:
    """Each ``function_call_output`` of the input answers a call made earlier (in the stored
    conversation or the input before it), and each call's arguments are a JSON object's text;
    400 naming the input item."""
    call_ids = {item["call_id"] for item in history if item.get("type") == "function_call"}
    for i, item in enumerate(items):
        if item["type"] == "function_call":
            try:
                arguments = load_json_text(item["arguments"])
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):
                raise bad_request(f"'input[{i}].arguments' must be the JSON text of an object",
                                  param=f"input[{i}].arguments")
            call_ids.add(item["call_id"])
        elif item["type"] == "function_call_output" and item["call_id"] not in call_ids:
            raise bad_request(f"call_id {item['call_id']!r:.80} matches no earlier function_call",
                              param=f"input[{i}].call_id")
