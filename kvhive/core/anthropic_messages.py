"""Anthropic's Messages API body as the chat the replica renders (torch-free; the replica and the
gateway share it, so both render one body to the same text).

``messages_chat`` checks a body's ``system``, ``messages``, ``tools`` and ``tool_choice`` and turns
them into chat completions' parts: string-content messages with ``tool_calls`` (from ``tool_use``
blocks) and ``tool`` messages (from ``tool_result`` blocks), function tools with the
``input_schema`` as their parameters, and a chat ``tool_choice`` ("any" is "required", a named tool
a named function). The text is then rendered through ``chat_template_input`` as chat completions
are (``render_chat``). A problem raises BodyError naming the body's field.

Cache breakpoints (``cache_control`` on a tool, a system block, a message content block or the
whole request, at most MAX_BREAKPOINTS) are placed on the rendered text: each breakpoint's
character offset is the common prefix of the full text and a probe rendered from the body cut just
after the breakpointed element (a tool or a system block followed by a sentinel, a message cut
after the block), so the offset always ends a true prefix of the prompt, whatever the template
writes around the element. Breakpoints follow Anthropic's order (tools, system, messages) and each
covers at least the one before it. ``breakpoint_tokens`` turns the offsets into prompt token counts:
the common prefix of the ids of the text up to the offset and of the whole text.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvhive.core.json_body import BodyError
from kvhive.core.tool_definitions import MAX_CALL_ID_CHARS, MAX_TOOLS, chat_functions, chat_template_input

if TYPE_CHECKING:
    from kvhive.core.tokenizer import Tokenizer

# Anthropic's bounds: at most 4 breakpoints, TTLs of 5 minutes (the default) or an hour.
MAX_BREAKPOINTS = 4
CACHE_TTL_S: Mapping[str, int] = {"5m": 300, "1h": 3600}
DEFAULT_TTL = "5m"
# At most this many messages (Anthropic's limit) and content blocks in one message.
MAX_MESSAGES = 100_000
MAX_BLOCKS = 10_000
# The probe text that follows a breakpointed tool or system block; never part of a real prompt.
SENTINEL = "\x00kvhive-cache-breakpoint\x00"
SENTINEL_TOOL = "kvhive_cache_breakpoint"

TEXT_KEYS = frozenset({"type", "text", "cache_control", "citations"})
TOOL_USE_KEYS = frozenset({"type", "id", "name", "input", "cache_control"})
TOOL_RESULT_KEYS = frozenset({"type", "tool_use_id", "content", "is_error", "cache_control"})
TOOL_KEYS = frozenset({"type", "name", "description", "input_schema", "cache_control", "strict"})
MESSAGE_KEYS = frozenset({"role", "content"})
CACHE_CONTROL_KEYS = frozenset({"type", "ttl"})
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
class CacheBreakpoint:
    """A ``cache_control`` breakpoint: the element it ends (``where``: ("tools", i), ("system", j) or
    ("messages", k, j), j None for a message's string content), its TTL and the field naming it."""

    where: tuple[Any, ...]
    ttl_s: int
    param: str


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


# ---------------------------------------------------------------- the body


def messages_chat(body: Mapping[str, Any]) -> MessagesChat:
    """The body's ``system``, ``messages``, ``tools``, ``tool_choice`` and ``cache_control`` checked
    and turned into chat parts; BodyError naming the field that is wrong."""
    breakpoints: list[CacheBreakpoint] = []
    tools = _tools(body.get("tools"), breakpoints)
    messages = _system(body.get("system"), breakpoints)
    messages += _messages(body.get("messages"), breakpoints)
    _top_level_breakpoint(body, breakpoints)
    _check_breakpoints(breakpoints)
    choice, parallel = _tool_choice(body.get("tool_choice"), tools)
    chat = MessagesChat(tuple(messages), tools, choice, parallel, tuple(breakpoints))
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
        _check_keys(tool, param, TOOL_KEYS)
        _add_breakpoint(tool, ("tools", i), param, breakpoints)
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
        _add_breakpoint(block, (*where, j), f"{param}[{j}]", breakpoints)
    return "\n".join(texts)


def _text_block(block: Any, param: str) -> str:
    if not isinstance(block, Mapping) or block.get("type") != "text":
        kind = block.get("type") if isinstance(block, Mapping) else type(block).__name__
        raise BodyError(f"'{param}' must be a text block, got type {kind!r:.60}", param=f"{param}.type")
    _check_keys(block, param, TEXT_KEYS)
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
        _check_keys(message, param, MESSAGE_KEYS)
        role, content = message.get("role"), message.get("content")
        if "content" not in message:
            raise BodyError(f"'{param}.content' is required", param=f"{param}.content")
        if role == "assistant" and k == len(raw) - 1:
            raise BodyError("A last message of role 'assistant' (a prefill to continue) is not served: end "
                            "with a user message", param=f"{param}.role")
        if role == "system":
            out.append({"role": "system", "content": _text_content(content, f"{param}.content",
                                                                   ("messages", k), breakpoints)})
        elif role == "user":
            out += _user_message(content, param, k, call_ids, breakpoints)
        elif role == "assistant":
            out.append(_assistant_message(content, param, k, call_ids, breakpoints))
        else:
            raise BodyError(f"'{param}.role' must be 'user', 'assistant' or 'system', got {role!r:.40}",
                            param=f"{param}.role")
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
            _add_nested_breakpoint(block, ("messages", k, j), f"{block_param}.content", breakpoints)
        elif kind == "text":
            texts.append(_text_block(block, block_param))
        else:
            raise BodyError(f"Content blocks of type {kind!r:.60} are not served in a user message",
                            param=f"{block_param}.type")
        _add_breakpoint(block, ("messages", k, j), block_param, breakpoints)
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _tool_result(block: Mapping[str, Any], param: str, call_ids: set[str]) -> dict[str, Any]:
    _check_keys(block, param, TOOL_RESULT_KEYS)
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


def _add_nested_breakpoint(block: Mapping[str, Any], where: tuple[Any, ...], param: str,
                           breakpoints: list[CacheBreakpoint]) -> None:
    """A breakpoint on a text block inside a tool result's content: the tool result's own (the
    prompt is cut after the whole result)."""
    content = block.get("content")
    for m, nested in enumerate(content if isinstance(content, list) else ()):
        _add_breakpoint(nested, where, f"{param}[{m}]", breakpoints)


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
        _add_breakpoint(block, ("messages", k, j), block_param, breakpoints)
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _tool_use(block: Mapping[str, Any], param: str, call_ids: set[str]) -> dict[str, Any]:
    _check_keys(block, param, TOOL_USE_KEYS)
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
    _check_keys(raw, "tool_choice", TOOL_CHOICE_KEYS[kind])
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


def _check_keys(value: Any, param: str, keys: frozenset[str]) -> None:
    if not isinstance(value, Mapping):
        raise BodyError(f"'{param}' must be an object", param=param)
    unknown = sorted(set(value) - keys)
    if unknown:
        raise BodyError(f"Unknown field '{unknown[0]:.80}' in '{param}'", param=f"{param}.{unknown[0]:.80}")


# ---------------------------------------------------------------- breakpoints


def _cache_ttl(raw: Any, param: str) -> int:
    """A ``cache_control`` object's TTL in seconds; BodyError for another type, TTL or field."""
    _check_keys(raw, param, CACHE_CONTROL_KEYS)
    if raw.get("type") != "ephemeral":
        raise BodyError(f"'{param}.type' must be 'ephemeral', got {raw.get('type')!r:.40}", param=f"{param}.type")
    ttl = raw.get("ttl", DEFAULT_TTL)
    if ttl is None:
        ttl = DEFAULT_TTL
    if ttl not in CACHE_TTL_S:
        raise BodyError(f"'{param}.ttl' must be '5m' or '1h', got {ttl!r:.40}", param=f"{param}.ttl")
    return CACHE_TTL_S[ttl]


def _add_breakpoint(element: Mapping[str, Any], where: tuple[Any, ...], param: str,
                    breakpoints: list[CacheBreakpoint]) -> None:
    raw = element.get("cache_control")
    if raw is None:
        return
    ttl_s = _cache_ttl(raw, f"{param}.cache_control")
    if element.get("type") == "text" and element.get("text") == "":
        raise BodyError("An empty text block cannot carry cache_control", param=f"{param}.cache_control")
    breakpoints.append(CacheBreakpoint(where, ttl_s, f"{param}.cache_control"))


def _top_level_breakpoint(body: Mapping[str, Any], breakpoints: list[CacheBreakpoint]) -> None:
    """The body's own ``cache_control``: a breakpoint on the last block of the last message."""
    raw = body.get("cache_control")
    if raw is None:
        return
    ttl_s = _cache_ttl(raw, "cache_control")
    k = len(body["messages"]) - 1
    content = body["messages"][k]["content"]
    where = ("messages", k, None) if isinstance(content, str) else ("messages", k, len(content) - 1)
    if any(b.where == where for b in breakpoints):
        return                  # already a breakpoint: the block carries one
    breakpoints.append(CacheBreakpoint(where, ttl_s, "cache_control"))


def _check_breakpoints(breakpoints: Sequence[CacheBreakpoint]) -> None:
    """At most MAX_BREAKPOINTS; a longer TTL never after a shorter one (Anthropic's rule)."""
    if len(breakpoints) > MAX_BREAKPOINTS:
        raise BodyError(f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. "
                        f"Found {len(breakpoints)}.", param=breakpoints[MAX_BREAKPOINTS].param)
    for before, after in zip(breakpoints, breakpoints[1:], strict=False):
        if after.ttl_s > before.ttl_s:
            raise BodyError("A cache_control with a longer ttl must come before those with a shorter one "
                            "(tools, then system, then messages)", param=after.param)


def probe_body(body: Mapping[str, Any], where: tuple[Any, ...]) -> dict[str, Any]:
    """``body`` changed just after the element ``where``: a sentinel tool or system block after it,
    or the messages cut after the block (no top-level ``cache_control``)."""
    probe = {k: v for k, v in body.items() if k != "cache_control"}
    kind, index = where[0], where[1]
    if kind == "tools":
        tools = list(body["tools"][:index + 1])
        names = {t.get("name") for t in tools}
        name = next(f"{SENTINEL_TOOL}_{n}" for n in range(len(names) + 1) if f"{SENTINEL_TOOL}_{n}" not in names)
        probe["tools"] = [*tools, {"name": name, "description": SENTINEL, "input_schema": {"type": "object"}}]
        probe.pop("tool_choice", None)
    elif kind == "system":
        probe["system"] = [*body["system"][:index + 1], {"type": "text", "text": SENTINEL}]
    else:
        messages = list(body["messages"][:index + 1])
        block = where[2]
        if block is not None:
            messages[index] = {**messages[index], "content": messages[index]["content"][:block + 1]}
        if messages[-1].get("role") == "assistant":
            messages.append({"role": "user", "content": SENTINEL})
        probe["messages"] = messages
    return probe


def breakpoint_chars(body: Mapping[str, Any], chat: MessagesChat, render: Callable[[MessagesChat], str]
                     ) -> tuple[str, list[int]]:
    """The body's rendered text (``render`` of ``chat``) and each breakpoint's character offset in it:
    the common prefix of the text and its probe's text, at least the offset before it."""
    text = render(chat)
    offsets: list[int] = []
    for breakpoint in chat.breakpoints:
        probe = render(messages_chat(probe_body(body, breakpoint.where)))
        offset = common_prefix_len(text, probe)
        offsets.append(max(offset, offsets[-1]) if offsets else offset)
    return text, offsets


def breakpoint_tokens(encode: Callable[[str], Sequence[int]], text: str, prompt_ids: Sequence[int],
                      offsets: Sequence[int]) -> list[int]:
    """How many prompt tokens (``prompt_ids``, the ids of ``text``) each character offset covers: the
    common prefix of ``encode(text[:offset])`` and the prompt's ids."""
    return [common_prefix_len(encode(text[:offset]), prompt_ids) if offset < len(text) else len(prompt_ids)
            for offset in offsets]


def common_prefix_len(a: Sequence[Any], b: Sequence[Any]) -> int:
    """How many leading items (characters, ids) ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


# ---------------------------------------------------------------- rendering


def render_chat(tokenizer: Tokenizer, chat: MessagesChat) -> str:
    """The chat template's text of ``chat``, as the replica renders chat completions (the tools and
    history through ``chat_template_input``). Raises BodyError, and what the template raises."""
    messages, variables = chat_template_input(tokenizer.chat_template, [dict(m) for m in chat.messages],
                                              chat_functions(chat.tools))
    return tokenizer.apply_chat_template(messages, **variables)
