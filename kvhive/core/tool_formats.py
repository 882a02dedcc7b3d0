"""Tool calling per model family (torch-free): which parser reads a chat template's calls, the
grammar spec that makes ``required`` and named tool choices write well-formed calls, and the chat
messages a template renders (``docs/tool_calling.md``).

A template that reads ``tools`` renders the definitions and the history itself, as transformers'
``apply_chat_template`` does; the calls in the history reach it with their ``arguments`` parsed
into objects (as vLLM passes them: templates write ``arguments | tojson``). A template that does
not read ``tools`` gets kvhive's own format, Hermes': the definitions appended to the system
message, the history's calls as ``<tool_call>`` text in the assistant's content, and the tool
results as ``tool`` messages when the template renders that role (else as ``user`` messages
wrapped in ``<tool_response>``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvhive.core.chat_template import ChatTemplate
from kvhive.core.structured_spec import StructuredSpec, ToolCallFormat
from kvhive.core.tool_parsers import HERMES_BEGIN, HERMES_END, MISTRAL_BEGIN, PYTHON_TAG, ParserName

TOOL_RESPONSE_BEGIN, TOOL_RESPONSE_END = "<tool_response>", "</tool_response>"
# The system text kvhive writes for a template without tool support (the Hermes format).
FALLBACK_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
FALLBACK_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


@dataclass(frozen=True)
class ToolFunction:
    """One function a request offers: the tool definition as the client sent it (what a template
    renders) and its parts."""

    name: str
    parameters: Mapping[str, Any]
    definition: Mapping[str, Any]        # {"type": "function", "function": {...}}


def parser_for_template(source: str | None) -> ParserName:
    """The call format a chat template's model writes: Mistral's when the template writes
    ``[TOOL_CALLS]``, Llama 3's JSON when it writes ``<|python_tag|>`` or the ``ipython`` role,
    else Hermes' (Qwen's, and kvhive's own for templates without tool support)."""
    text = source or ""
    if MISTRAL_BEGIN in text:
        return "mistral"
    if PYTHON_TAG in text or "ipython" in text:
        return "llama3_json"
    return "hermes"


def arguments_key(parser: ParserName) -> str:
    """The key a family's call object names its arguments with."""
    return "parameters" if parser == "llama3_json" else "arguments"


def tool_calls_spec(functions: Sequence[ToolFunction], parser: ParserName, *, max_calls: int | None,
                    source: str = "tool_choice") -> StructuredSpec:
    """The grammar spec of calls to ``functions`` in the family's format: one call at least,
    ``max_calls`` at most (None: any number), each naming one of the functions and passing
    arguments matching its parameters. The schema text keeps its keys' order (``name`` before the
    arguments, as the families write them; the grammar writes properties in schema order)."""
    key = arguments_key(parser)
    options = [{"type": "object", "properties": {"name": {"const": f.name}, key: f.parameters},
                "required": ["name", key], "additionalProperties": False} for f in functions]
    call = options[0] if len(options) == 1 else {"anyOf": options}
    if parser == "mistral":
        schema = {"type": "array", "items": call, "minItems": 1}
        if max_calls is not None:
            schema["maxItems"] = max_calls
        fmt = ToolCallFormat(begin=MISTRAL_BEGIN, end="", separator="", min_calls=1, max_calls=1)
    elif parser == "llama3_json":
        schema = call
        fmt = ToolCallFormat(begin="", end="", separator="; ", min_calls=1, max_calls=max_calls)
    else:
        schema = call
        fmt = ToolCallFormat(begin=HERMES_BEGIN + "\n", end="\n" + HERMES_END, separator="\n",
                             min_calls=1, max_calls=max_calls)
    text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    return StructuredSpec(kind="tool_calls", schema=text, tool_format=fmt, source=source)


def canonical_json(value: Any) -> str:
    """JSON text with sorted keys and no spaces (a spec's schema text)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def call_text(name: str, arguments: Any, parser: ParserName = "hermes") -> str:
    """One call as the family writes it (the fallback history writes Hermes')."""
    body = json.dumps({"name": name, arguments_key(parser): arguments}, ensure_ascii=False)
    if parser == "llama3_json":
        return body
    if parser == "mistral":
        return f"{MISTRAL_BEGIN}[{body}]"
    return f"{HERMES_BEGIN}\n{body}\n{HERMES_END}"


def fallback_system_text(functions: Sequence[ToolFunction]) -> str:
    """The tool definitions as kvhive writes them into the system message of a template without
    tool support: one JSON definition a line between ``<tools>`` tags, then how to call."""
    lines = "".join("\n" + json.dumps(f.definition, ensure_ascii=False) for f in functions)
    return FALLBACK_TOOLS_HEADER + lines + FALLBACK_TOOLS_FOOTER


def tool_prompt(template: ChatTemplate | None, messages: list[dict[str, Any]], functions: Sequence[ToolFunction]
                ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and the template variables that render them with ``functions``: through the
    template's ``tools`` argument when it reads one, else in kvhive's own format. Messages without
    calls or tool results, and no functions, are rendered as they are."""
    has_history = any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
    if not functions and not has_history:
        return messages, {}
    if template is not None and template.reads("tools"):
        tools = [dict(f.definition) for f in functions] or None
        return messages_for_template(messages), {"tools": tools}
    renders = template.renders_role if template is not None else (lambda _role: False)
    return messages_without_tool_support(messages, functions, renders), {}


def messages_for_template(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages for a template that reads ``tools``: each call's ``arguments`` JSON text parsed
    into its value (the caller has checked it is JSON)."""
    rendered = []
    for message in messages:
        entry = dict(message)
        if entry.get("tool_calls"):
            entry["tool_calls"] = [
                {**call, "function": {**call["function"], "arguments": json.loads(call["function"]["arguments"])}}
                for call in entry["tool_calls"]]
        rendered.append(entry)
    return rendered


def messages_without_tool_support(messages: Sequence[Mapping[str, Any]], functions: Sequence[ToolFunction],
                                  renders_role: Callable[[str], bool]) -> list[dict[str, Any]]:
    """Chat messages for a template that does not read ``tools``: the definitions appended to the
    system message (or in a system message of their own first; where the template renders no
    system message, before the first message's text), each assistant call written in its content
    as Hermes text, tool results as ``tool`` messages when ``renders_role("tool")``, else as ``user``
    messages wrapped in ``<tool_response>`` tags."""
    out: list[dict[str, Any]] = []
    if functions:
        system = fallback_system_text(functions)
        first = messages[0] if messages else None
        if first is not None and (first.get("role") == "system" or not renders_role("system")):
            out.append({**first, "content": f"{system}\n\n{first.get('content') or ''}".rstrip("\n")
                        if first.get("role") != "system" else
                        f"{first.get('content') or ''}\n\n{system}".lstrip("\n")})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": system})
    tool_role = renders_role("tool")
    for message in messages:
        if message.get("tool_calls"):
            calls = [call_text(c["function"]["name"], json.loads(c["function"]["arguments"]))
                     for c in message["tool_calls"]]
            text = "\n".join(([message["content"]] if message.get("content") else []) + calls)
            out.append({"role": "assistant", "content": text})
        elif message.get("role") == "tool" and not tool_role:
            out.append({"role": "user",
                        "content": f"{TOOL_RESPONSE_BEGIN}\n{message.get('content') or ''}\n{TOOL_RESPONSE_END}"})
        elif message.get("role") == "tool":
            out.append({"role": "tool", "content": message.get("content") or ""})
        else:
            out.append(dict(message))
    return out
