"""A request's tool definitions and tool-call history, checked (torch-free): the functions a chat
completions or Responses body offers, and the calls and results its messages carry. The replicas
answer a problem as a 400 naming the field (``kvhive.server.tools``); the gateway, rendering the
same prompt to route by KV (``kvhive.routing.prompts``), routes such a body by load instead.
``chat_template_input`` is what both hand the chat template (``docs/tool_calling.md``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvhive.core.json_body import BodyError, load_json_text
from kvhive.core.tool_formats import ToolFunction, canonical_json, tool_prompt

if TYPE_CHECKING:
    from kvhive.core.chat_template import ChatTemplate

# OpenAI's bounds on a request's tools, and kvhive's on what their text may hold.
MAX_TOOLS = 128
FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
MAX_DESCRIPTION_CHARS = 16384
MAX_PARAMETERS_CHARS = 65536            # a function's parameters schema as canonical JSON
MAX_CALL_ID_CHARS = 256
CHAT_TOOL_KEYS, CHAT_FUNCTION_KEYS = frozenset({"type", "function"}), frozenset(
    {"name", "description", "parameters", "strict"})
RESPONSES_TOOL_KEYS = frozenset({"type", "name", "description", "parameters", "strict"})


def chat_functions(tools: Sequence[Any] | None) -> tuple[ToolFunction, ...]:
    """Chat completions' ``tools`` ([{type: "function", function: {name, description, parameters,
    strict}}]) checked; BodyError naming the field that is wrong."""
    return _functions(tools, _chat_function)


def _chat_function(tool: Any, param: str) -> ToolFunction:
    check_object(tool, param, CHAT_TOOL_KEYS)
    _check_type(tool.get("type"), f"{param}.type")
    function = tool.get("function")
    check_object(function, f"{param}.function", CHAT_FUNCTION_KEYS)
    return _function(function, {"type": "function", "function": dict(function)}, f"{param}.function")


def responses_functions(tools: Sequence[Any] | None) -> tuple[ToolFunction, ...]:
    """The Responses API's ``tools`` ([{type: "function", name, description, parameters, strict}])
    checked; other tool types (web search, file search, ...) are refused by name."""
    return _functions(tools, _responses_function)


def _responses_function(tool: Any, param: str) -> ToolFunction:
    if isinstance(tool, Mapping) and tool.get("type") != "function":
        raise BodyError(f"Tools of type {tool.get('type')!r:.40} are not supported; only 'function' tools",
                          param=f"{param}.type")
    check_object(tool, param, RESPONSES_TOOL_KEYS)
    body = {k: v for k, v in tool.items() if k != "type"}
    return _function(tool, {"type": "function", "function": body}, param)


def _functions(tools: Sequence[Any] | None, one: Callable[[Any, str], ToolFunction]) -> tuple[ToolFunction, ...]:
    """Each tool checked by ``one`` (given its field name), their count and their names' uniqueness."""
    if tools is None:
        return ()
    _check_count(tools, "tools")
    functions = tuple(one(tool, f"tools[{i}]") for i, tool in enumerate(tools))
    _check_unique(functions)
    return functions


def _function(function: Mapping[str, Any], definition: dict[str, Any], param: str) -> ToolFunction:
    name = function.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise BodyError(f"'{param}.name' must be 1 to 64 letters, digits, '_' or '-', got {name!r:.80}",
                          param=f"{param}.name")
    description = function.get("description")
    if description is not None and (not isinstance(description, str) or len(description) > MAX_DESCRIPTION_CHARS):
        raise BodyError(f"'{param}.description' must be a string of at most {MAX_DESCRIPTION_CHARS} characters",
                          param=f"{param}.description")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise BodyError(f"'{param}.strict' must be a boolean", param=f"{param}.strict")
    parameters = function.get("parameters")
    if parameters is None or parameters == {}:
        parameters = {"type": "object", "properties": {}}       # no arguments
    _check_parameters(parameters, f"{param}.parameters")
    return ToolFunction(name, parameters, definition)


def _check_parameters(parameters: Any, param: str) -> None:
    """A function's parameters: a JSON schema of an object, of bounded size."""
    if not isinstance(parameters, Mapping):
        raise BodyError(f"'{param}' must be a JSON schema object, got {type(parameters).__name__}", param=param)
    kind = parameters.get("type")
    if kind is not None and kind != "object":
        raise BodyError(f"'{param}' must describe an object (type 'object'), got type {kind!r:.40}", param=param)
    if kind is None and "properties" not in parameters:
        raise BodyError(f"'{param}' must describe an object: give it type 'object' and its properties",
                          param=param)
    if len(canonical_json(parameters)) > MAX_PARAMETERS_CHARS:
        raise BodyError(f"'{param}' is larger than {MAX_PARAMETERS_CHARS} characters of JSON", param=param)


def _check_count(tools: Sequence[Any], param: str) -> None:
    if len(tools) > MAX_TOOLS:
        raise BodyError(f"'{param}' holds at most {MAX_TOOLS} tools, got {len(tools)}", param=param)


def check_object(value: Any, param: str, keys: frozenset[str]) -> None:
    """BodyError unless ``value`` is an object whose fields are all in ``keys`` (naming the first other)."""
    if not isinstance(value, Mapping):
        raise BodyError(f"'{param}' must be an object", param=param)
    unknown = sorted(set(value) - keys)
    if unknown:
        raise BodyError(f"Unknown field '{unknown[0]}' in '{param}'", param=f"{param}.{unknown[0]}")


def _check_type(kind: Any, param: str) -> None:
    if kind != "function":
        raise BodyError(f"Tools of type {kind!r:.40} are not supported; only 'function' tools", param=param)


def _check_unique(functions: Sequence[ToolFunction]) -> None:
    seen: set[str] = set()
    for i, function in enumerate(functions):
        if function.name in seen:
            raise BodyError(f"Duplicate tool name '{function.name}': each tool needs its own name",
                              param=f"tools[{i}]")
        seen.add(function.name)



def check_history(messages: Sequence[Mapping[str, Any]], params: Sequence[str]) -> None:
    """The history's calls: each ``arguments`` a JSON object's text, each call id unique and bounded,
    each tool result's ``tool_call_id`` naming an earlier call. ``params[i]`` names message i's field."""
    call_ids: set[str] = set()
    for i, message in enumerate(messages):
        for j, call in enumerate(message.get("tool_calls") or ()):
            param = f"{params[i]}.tool_calls[{j}]"
            call_id = call["id"]
            if not 0 < len(call_id) <= MAX_CALL_ID_CHARS:
                raise BodyError(f"'{param}.id' must be 1 to {MAX_CALL_ID_CHARS} characters", param=f"{param}.id")
            call_ids.add(call_id)
            try:
                arguments = load_json_text(call["function"]["arguments"])
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):
                raise BodyError(f"'{param}.function.arguments' must be the JSON text of an object",
                                  param=f"{param}.function.arguments")
        if message.get("role") == "tool" and message.get("tool_call_id") not in call_ids:
            raise BodyError(f"tool_call_id {message.get('tool_call_id')!r:.80} matches no earlier tool call",
                              param=f"{params[i]}.tool_call_id")


def chat_template_input(template: ChatTemplate | None, messages: list[dict[str, Any]],
                        functions: Sequence[ToolFunction], param: str = "messages"
                        ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages (as the template takes them: string content, ``tool_calls`` and
    ``tool_call_id`` as sent) and the template variables that render them with ``functions``: the
    history checked (``check_history``, naming ``param[i]``), then ``tool_prompt``."""
    check_history(messages, [f"{param}[{i}]" for i in range(len(messages))])
    return tool_prompt(template, messages, functions)
