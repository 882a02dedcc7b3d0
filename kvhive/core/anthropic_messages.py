"""Anthropic's Messages API body as the chat the replica renders (torch-free; the replica and the
gateway share it, so both render one body to the same text).

``messages_chat`` checks a body's ``system``, ``messages``, ``tools`` and ``tool_choice`` and turns
them into chat completions' parts: string-content messages with ``tool_calls`` (from ``tool_use``
blocks) and ``tool`` messages (from ``tool_result`` blocks), function tools with the
``input_schema`` as their parameters, and a chat ``tool_choice`` ("any" is "required", a named tool
a named function). The text is then rendered through ``chat_template_input`` as chat completions
are (``render_chat``); a body whose last message is the assistant's (a prefill) is rendered with
that message left open, so the answer goes on from its text. A problem raises BodyError naming the
body's field.

Cache breakpoints (``cache_control`` on a tool, a system block, a message content block or the
whole request, at most MAX_BREAKPOINTS, TTL "5m" or "1h") are checked and listed in Anthropic's
order (tools, system, messages) as ``CacheBreakpoint``s; ``kvhive.core.anthropic_breakpoints``
places them on the rendered prompt.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvhive.core.anthropic_breakpoints import (
    CacheBreakpoint,
    add_breakpoint,
    add_nested_breakpoint,
    check_breakpoints,
    top_level_breakpoint,
)
from kvhive.core.json_body import BodyError
from kvhive.core.tool_definitions import (
    MAX_CALL_ID_CHARS,
    MAX_TOOLS,
    chat_functions,
    chat_template_input,
    check_object,
)

if TYPE_CHECKING:
    from kvhive.core.tokenizer import Tokenizer

# At most this many messages (Anthropic's limit) and content blocks in one message.
MAX_MESSAGES = 100_000
MAX_BLOCKS = 10_000

TEXT_KEYS = frozenset({"type", "text", "cache_control", "citations"})
TOOL_USE_KEYS = frozenset({"type", "id", "name", "input", "cache_control"})
TOOL_RESULT_KEYS = frozenset({"type", "tool_use_id", "content", "is_error", "cache_control"})
TOOL_KEYS = frozenset({"type", "name", "description", "input_schema", "cache_control", "strict"})
MESSAGE_KEYS = frozenset({"role", "content"})
TOOL_CHOICE_KEYS: Mapping[str, frozenset[str]] = {
    "auto": frozenset({"type", "disable_parallel_tool_use"}),
    "any": frozenset({"type", "disable_parallel_tool_use"}),
    "tool": frozenset({"type", "name", "disable_parallel_tool_use"}),
    "none": frozenset({"type"}),
}
# Block types of Anthropic's API that kvhive does not serve, with why.
UNSERVED_BLOCKS: Mapping[str, str] = {
    "image": "this model reads text only",
    "document": "this model reads text only",
    "search_result": "search results are not served",
    "thinking": "extended thinking is not served",
    "redacted_thinking": "extended thinking is not served",
    "server_tool_use": "server tools are not served",
    "web_search_tool_result": "server tools are not served",
    "container_upload": "containers are not served",
}


@dataclass(frozen=True)
class MessagesChat:
    """An Anthropic body as chat completions' parts: the messages as the chat template takes them,
    the function tools as chat completions sends them, the chat ``tool_choice``, whether several
    calls may come in one answer, and the body's cache breakpoints in Anthropic's order."""

    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] | None
    tool_choice: str | dict[str, Any] | None
    parallel_tool_calls: bool
    breakpoints: tuple[CacheBreakpoint, ...] = field(default=())
    # The last message is the assistant's: the model goes on with its text (a prefill).
    prefill: bool = False


# ---------------------------------------------------------------- the body


def messages_chat(body: Mapping[str, Any]) -> MessagesChat:
    """The body's ``system``, ``messages``, ``tools``, ``tool_choice`` and ``cache_control`` checked
    and turned into chat parts; BodyError naming the field that is wrong."""
    breakpoints: list[CacheBreakpoint] = []
    tools = _tools(body.get("tools"), breakpoints)
    messages = _system(body.get("system"), breakpoints)
    messages += _messages(body.get("messages"), breakpoints)
    top_level_breakpoint(body, breakpoints)
    check_breakpoints(breakpoints)
    choice, parallel = _tool_choice(body.get("tool_choice"), tools)
    prefill = messages[-1]["role"] == "assistant"
    chat = MessagesChat(tuple(messages), tools, choice, parallel, tuple(breakpoints), prefill)
    _check_functions(chat.tools)
    return chat


def _tools(raw: Any, breakpoints: list[CacheBreakpoint]) -> tuple[dict[str, Any], ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise BodyError("'tools' must be a list of tools", param="tools")
    if len(raw) > MAX_TOOLS:
        raise BodyError(f"'tools' holds at most {MAX_TOOLS} tools, got {len(raw)}", param="tools")
    out = []
    for i, tool in enumerate(raw):
        param = f"tools[{i}]"
        if isinstance(tool, Mapping) and tool.get("type") not in (None, "custom"):
            raise BodyError(f"Tools of type {tool.get('type')!r:.60} (server tools) are not served; only "
                            f"client tools (type 'custom' or none)", param=f"{param}.type")
        check_object(tool, param, TOOL_KEYS)
        add_breakpoint(tool, ("tools", i), param, breakpoints)
        if "input_schema" not in tool:
            raise BodyError(f"'{param}.input_schema' is required", param=f"{param}.input_schema")
        function: dict[str, Any] = {"name": tool.get("name")}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        function["parameters"] = tool["input_schema"]
        if tool.get("strict") is not None:
            function["strict"] = tool["strict"]
        out.append({"type": "function", "function": function})
    return tuple(out)


def _check_functions(tools: tuple[dict[str, Any], ...] | None) -> None:
    """The tools through chat completions' own checks, the field renamed to the body's."""
    try:
        chat_functions(tools)
    except BodyError as exc:
        param = (exc.param or "tools").replace(".function.parameters", ".input_schema").replace(".function", "")
        message = exc.message.replace(".function.parameters", ".input_schema").replace(".function", "")
        raise BodyError(message, param=param) from None


def _system(raw: Any, breakpoints: list[CacheBreakpoint]) -> list[dict[str, Any]]:
    if raw is None:
        return []
    text = _text_content(raw, "system", ("system",), breakpoints)
    return [{"role": "system", "content": text}] if text or isinstance(raw, str) else []


def _text_content(raw: Any, param: str, where: tuple[Any, ...], breakpoints: list[CacheBreakpoint]) -> str:
    """A string, or text blocks joined by newlines (their breakpoints recorded at ``where + (j,)``)."""
    if isinstance(raw, str):
        return raw
    blocks = _blocks(raw, param)
    texts = []
    for j, block in enumerate(blocks):
        texts.append(_text_block(block, f"{param}[{j}]"))
        add_breakpoint(block, (*where, j), f"{param}[{j}]", breakpoints)
    return "\n".join(texts)


def _text_block(block: Any, param: str) -> str:
    if not isinstance(block, Mapping) or block.get("type") != "text":
        kind = block.get("type") if isinstance(block, Mapping) else type(block).__name__
        raise BodyError(f"'{param}' must be a text block, got type {kind!r:.60}", param=f"{param}.type")
    check_object(block, param, TEXT_KEYS)
    if block.get("citations"):
        raise BodyError(f"'{param}.citations' are not served", param=f"{param}.citations")
    text = block.get("text")
    if not isinstance(text, str):
        raise BodyError(f"'{param}.text' must be a string", param=f"{param}.text")
    return text


def _blocks(raw: Any, param: str) -> list[Any]:
    if not isinstance(raw, list):
        raise BodyError(f"'{param}' must be a string or a list of content blocks", param=param)
    if len(raw) > MAX_BLOCKS:
        raise BodyError(f"'{param}' holds at most {MAX_BLOCKS} blocks, got {len(raw)}", param=param)
    return raw


def _messages(raw: Any, breakpoints: list[CacheBreakpoint]) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise BodyError("'messages' must be a list of at least one message", param="messages")
    if len(raw) > MAX_MESSAGES:
        raise BodyError(f"'messages' holds at most {MAX_MESSAGES} messages, got {len(raw)}", param="messages")
    out: list[dict[str, Any]] = []
    call_ids: set[str] = set()
    for k, message in enumerate(raw):
        param = f"messages[{k}]"
        check_object(message, param, MESSAGE_KEYS)
        role, content = message.get("role"), message.get("content")
        if "content" not in message:
            raise BodyError(f"'{param}.content' is required", param=f"{param}.content")
        if role == "system":
            out.append({"role": "system", "content": _text_content(content, f"{param}.content",
                                                                   ("messages", k), breakpoints)})
        elif role == "user":
            out += _user_message(content, param, k, call_ids, breakpoints)
        elif role == "assistant":
            out.append(_assistant_message(content, param, k, call_ids, breakpoints))
            if k == len(raw) - 1:
                _check_prefill(out[-1], param)
        else:
            raise BodyError(f"'{param}.role' must be 'user', 'assistant' or 'system', got {role!r:.40}",
                            param=f"{param}.role")
    return _combined_turns(out)


def _check_prefill(message: Mapping[str, Any], param: str) -> None:
    """A last assistant message is text the answer goes on from: no tool calls (their results
    would have to follow), and, as Anthropic requires, no trailing whitespace."""
    if message.get("tool_calls"):
        raise BodyError("A last assistant message (a prefill the answer goes on from) cannot hold tool_use "
                        "blocks: their tool_result blocks must follow in a user message", param=f"{param}.content")
    if message["content"] != message["content"].rstrip():
        raise BodyError("A last assistant message (a prefill the answer goes on from) cannot end with "
                        "whitespace", param=f"{param}.content")


def _combined_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive user (or assistant) turns as one, their texts joined by a newline, as Anthropic
    combines them; a turn with calls or a tool result stays its own."""
    out: list[dict[str, Any]] = []
    for message in messages:
        previous = out[-1] if out else None
        if (previous is not None and previous["role"] == message["role"] in ("user", "assistant")
                and set(previous) == set(message) == {"role", "content"}):
            out[-1] = {**previous, "content": f"{previous['content']}\n{message['content']}"}
        else:
            out.append(message)
    return out


def _user_message(content: Any, param: str, k: int, call_ids: set[str],
                  breakpoints: list[CacheBreakpoint]) -> list[dict[str, Any]]:
    """A user message: its text as user messages and each ``tool_result`` as a ``tool`` message,
    in the order the blocks come."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(_blocks(content, f"{param}.content")):
        block_param = f"{param}.content[{j}]"
        kind = _block_type(block, block_param)
        if kind == "tool_result":
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            out.append(_tool_result(block, block_param, call_ids))
            add_nested_breakpoint(block, ("messages", k, j), f"{block_param}.content", breakpoints)
        elif kind == "text":
            texts.append(_text_block(block, block_param))
        else:
            raise BodyError(f"Content blocks of type {kind!r:.60} are not served in a user message",
                            param=f"{block_param}.type")
        add_breakpoint(block, ("messages", k, j), block_param, breakpoints)
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _tool_result(block: Mapping[str, Any], param: str, call_ids: set[str]) -> dict[str, Any]:
    check_object(block, param, TOOL_RESULT_KEYS)
    call_id = block.get("tool_use_id")
    if call_id not in call_ids:
        raise BodyError(f"tool_use_id {call_id!r:.80} matches no earlier tool_use block",
                        param=f"{param}.tool_use_id")
    raw = block.get("content")
    text = "" if raw is None else _tool_result_text(raw, f"{param}.content")
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise BodyError(f"'{param}.is_error' must be a boolean", param=f"{param}.is_error")
    if is_error:
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _tool_result_text(raw: Any, param: str) -> str:
    """A tool result's content: a string or text blocks (a breakpoint on one of them is the tool
    result's own, whose block the caller records)."""
    if isinstance(raw, str):
        return raw
    return "\n".join(_text_block(block, f"{param}[{m}]") for m, block in enumerate(_blocks(raw, param)))


def _assistant_message(content: Any, param: str, k: int, call_ids: set[str],
                       breakpoints: list[CacheBreakpoint]) -> dict[str, Any]:
    """An assistant message: its text blocks as the content, its ``tool_use`` blocks as calls."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(_blocks(content, f"{param}.content")):
        block_param = f"{param}.content[{j}]"
        kind = _block_type(block, block_param)
        if kind == "tool_use":
            calls.append(_tool_use(block, block_param, call_ids))
        elif kind == "text":
            texts.append(_text_block(block, block_param))
        else:
            raise BodyError(f"Content blocks of type {kind!r:.60} are not served in an assistant message",
                            param=f"{block_param}.type")
        add_breakpoint(block, ("messages", k, j), block_param, breakpoints)
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _tool_use(block: Mapping[str, Any], param: str, call_ids: set[str]) -> dict[str, Any]:
    check_object(block, param, TOOL_USE_KEYS)
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str) or not 0 < len(call_id) <= MAX_CALL_ID_CHARS:
        raise BodyError(f"'{param}.id' must be 1 to {MAX_CALL_ID_CHARS} characters", param=f"{param}.id")
    if call_id in call_ids:
        raise BodyError(f"tool_use id {call_id!r:.80} is used twice", param=f"{param}.id")
    if not isinstance(name, str) or not name:
        raise BodyError(f"'{param}.name' must be a tool's name", param=f"{param}.name")
    if not isinstance(arguments, Mapping):
        raise BodyError(f"'{param}.input' must be an object", param=f"{param}.input")
    call_ids.add(call_id)
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _block_type(block: Any, param: str) -> str:
    if not isinstance(block, Mapping) or not isinstance(block.get("type"), str):
        raise BodyError(f"'{param}' must be a content block with a 'type'", param=param)
    kind = block["type"]
    if kind in UNSERVED_BLOCKS:
        raise BodyError(f"Content blocks of type '{kind}' are not served: {UNSERVED_BLOCKS[kind]}",
                        param=f"{param}.type")
    return kind


def _tool_choice(raw: Any, tools: tuple[dict[str, Any], ...] | None) -> tuple[str | dict[str, Any] | None, bool]:
    """Anthropic's ``tool_choice`` as chat's and whether parallel calls are allowed."""
    if raw is None:
        return None, True
    kind = raw.get("type") if isinstance(raw, Mapping) else None
    if kind not in TOOL_CHOICE_KEYS:
        raise BodyError("'tool_choice.type' must be 'auto', 'any', 'tool' or 'none'", param="tool_choice.type")
    check_object(raw, "tool_choice", TOOL_CHOICE_KEYS[kind])
    single = raw.get("disable_parallel_tool_use")
    if single is not None and not isinstance(single, bool):
        raise BodyError("'tool_choice.disable_parallel_tool_use' must be a boolean",
                        param="tool_choice.disable_parallel_tool_use")
    if kind != "none" and not tools:
        raise BodyError(f"tool_choice '{kind}' needs 'tools'", param="tool_choice")
    if kind == "tool":
        name = raw.get("name")
        if not any(t["function"]["name"] == name for t in tools or ()):
            raise BodyError(f"tool_choice names tool {name!r:.80}, which is not in 'tools'", param="tool_choice.name")
        return {"type": "function", "function": {"name": name}}, not single
    return {"auto": "auto", "any": "required", "none": "none"}[kind], not single


# ---------------------------------------------------------------- rendering


def render_chat(tokenizer: Tokenizer, chat: MessagesChat) -> str:
    """The chat template's text of ``chat``, as the replica renders chat completions (the tools and
    history through ``chat_template_input``). Raises BodyError, and what the template raises."""
    messages, variables = chat_template_input(tokenizer.chat_template, [dict(m) for m in chat.messages],
                                              chat_functions(chat.tools))
    return tokenizer.apply_chat_template(messages, add_generation_prompt=not chat.prefill,
                                         continue_final_message=chat.prefill, **variables)


def render_body(tokenizer: Tokenizer, body: Mapping[str, Any]) -> str:
    """``render_chat`` of a whole body (``messages_chat`` first): what breakpoint probes render."""
    return render_chat(tokenizer, messages_chat(body))
