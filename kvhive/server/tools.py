"""A request's tools, checked once: the functions it offers, its ``tool_choice``, the history's calls
and results, and what that makes of the prompt, the grammar and the output parsing (``ToolPlan``).
Chat completions and the Responses API both build their plan here (``docs/tool_calling.md``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from kvhive.core.structured_spec import StructuredSpec
from kvhive.core.tool_formats import (
    ToolFunction,
    canonical_json,
    parser_for_template,
    tool_calls_spec,
    tool_prompt,
)
from kvhive.core.tool_parsers import PARSER_NAMES, ParserName
from kvhive.request import SamplingParams
from kvhive.server.errors import bad_request

if TYPE_CHECKING:
    from kvhive.core.chat_template import ChatTemplate
    from kvhive.engine.client import EngineClient

# OpenAI's bounds on a request's tools, and kvhive's on what their text may hold.
MAX_TOOLS = 128
FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
MAX_DESCRIPTION_CHARS = 16384
MAX_PARAMETERS_CHARS = 65536            # a function's parameters schema as canonical JSON
MAX_CALL_ID_CHARS = 256
CHAT_TOOL_KEYS, CHAT_FUNCTION_KEYS = frozenset({"type", "function"}), frozenset(
    {"name", "description", "parameters", "strict"})
RESPONSES_TOOL_KEYS = frozenset({"type", "name", "description", "parameters", "strict"})
TOOL_CALL_PARSERS = ("auto", *PARSER_NAMES)

ChoiceMode = Literal["none", "auto", "required", "function"]


@dataclass(frozen=True)
class ToolChoice:
    """What ``tool_choice`` asks: no calls, the model's choice, at least one call, or one call of
    the function ``name``."""

    mode: ChoiceMode
    name: str | None = None


NO_TOOLS = ToolChoice("none")


@dataclass(frozen=True)
class ToolPlan:
    """How one request serves its tools: the prompt's definitions, the parser of the output, and the
    grammar spec when the choice forces calls."""

    functions: tuple[ToolFunction, ...]
    choice: ToolChoice
    parallel: bool
    parser: ParserName
    spec: StructuredSpec | None

    @property
    def parses_calls(self) -> bool:
        """Whether the output is read for calls (tools offered and ``tool_choice`` not "none")."""
        return bool(self.functions) and self.choice.mode != "none"

    @property
    def max_calls(self) -> int | None:
        """The most calls reported (None: any number): one for a named choice, without
        ``parallel_tool_calls``, and for Llama 3 (its template renders one call per turn)."""
        single = self.choice.mode == "function" or not self.parallel or self.parser == "llama3_json"
        return 1 if single else None

    def with_spec(self, sampling: SamplingParams) -> SamplingParams:
        """``sampling`` decoding under the plan's grammar; 400 when the request already asks for
        another output constraint (``response_format``)."""
        if self.spec is None:
            return sampling
        if sampling.structured is not None:
            raise bad_request(f"'{sampling.structured.source}' cannot be combined with tool_choice "
                              f"'{self.choice.mode}', which constrains the output to tool calls",
                              param=sampling.structured.source)
        return replace(sampling, structured=self.spec)


NO_PLAN = ToolPlan((), NO_TOOLS, True, "hermes", None)


# ---------------------------------------------------------------- definitions


def chat_functions(tools: Sequence[Any] | None) -> tuple[ToolFunction, ...]:
    """Chat completions' ``tools`` ([{type: "function", function: {name, description, parameters,
    strict}}]) checked; 400 naming the field that is wrong."""
    return _functions(tools, _chat_function)


def _chat_function(tool: Any, param: str) -> ToolFunction:
    _check_object(tool, param, CHAT_TOOL_KEYS)
    _check_type(tool.get("type"), f"{param}.type")
    function = tool.get("function")
    _check_object(function, f"{param}.function", CHAT_FUNCTION_KEYS)
    return _function(function, {"type": "function", "function": dict(function)}, f"{param}.function")


def responses_functions(tools: Sequence[Any] | None) -> tuple[ToolFunction, ...]:
    """The Responses API's ``tools`` ([{type: "function", name, description, parameters, strict}])
    checked; other tool types (web search, file search, ...) are refused by name."""
    return _functions(tools, _responses_function)


def _responses_function(tool: Any, param: str) -> ToolFunction:
    if isinstance(tool, Mapping) and tool.get("type") != "function":
        raise bad_request(f"Tools of type {tool.get('type')!r:.40} are not supported; only 'function' tools",
                          param=f"{param}.type")
    _check_object(tool, param, RESPONSES_TOOL_KEYS)
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
        raise bad_request(f"'{param}.name' must be 1 to 64 letters, digits, '_' or '-', got {name!r:.80}",
                          param=f"{param}.name")
    description = function.get("description")
    if description is not None and (not isinstance(description, str) or len(description) > MAX_DESCRIPTION_CHARS):
        raise bad_request(f"'{param}.description' must be a string of at most {MAX_DESCRIPTION_CHARS} characters",
                          param=f"{param}.description")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"'{param}.strict' must be a boolean", param=f"{param}.strict")
    parameters = function.get("parameters")
    if parameters is None or parameters == {}:
        parameters = {"type": "object", "properties": {}}       # no arguments
    _check_parameters(parameters, f"{param}.parameters")
    return ToolFunction(name, parameters, definition)


def _check_parameters(parameters: Any, param: str) -> None:
    """A function's parameters: a JSON schema of an object, of bounded size."""
    if not isinstance(parameters, Mapping):
        raise bad_request(f"'{param}' must be a JSON schema object, got {type(parameters).__name__}", param=param)
    kind = parameters.get("type")
    if kind is not None and kind != "object":
        raise bad_request(f"'{param}' must describe an object (type 'object'), got type {kind!r:.40}", param=param)
    if kind is None and "properties" not in parameters:
        raise bad_request(f"'{param}' must describe an object: give it type 'object' and its properties",
                          param=param)
    if len(canonical_json(parameters)) > MAX_PARAMETERS_CHARS:
        raise bad_request(f"'{param}' is larger than {MAX_PARAMETERS_CHARS} characters of JSON", param=param)


def _check_count(tools: Sequence[Any], param: str) -> None:
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"'{param}' holds at most {MAX_TOOLS} tools, got {len(tools)}", param=param)


def _check_object(value: Any, param: str, keys: frozenset[str]) -> None:
    if not isinstance(value, Mapping):
        raise bad_request(f"'{param}' must be an object", param=param)
    unknown = sorted(set(value) - keys)
    if unknown:
        raise bad_request(f"Unknown field '{unknown[0]}' in '{param}'", param=f"{param}.{unknown[0]}")


def _check_type(kind: Any, param: str) -> None:
    if kind != "function":
        raise bad_request(f"Tools of type {kind!r:.40} are not supported; only 'function' tools", param=param)


def _check_unique(functions: Sequence[ToolFunction]) -> None:
    seen: set[str] = set()
    for i, function in enumerate(functions):
        if function.name in seen:
            raise bad_request(f"Duplicate tool name '{function.name}': each tool needs its own name",
                              param=f"tools[{i}]")
        seen.add(function.name)


# ---------------------------------------------------------------- tool_choice


def tool_choice(value: Any, functions: Sequence[ToolFunction], *, flat: bool) -> ToolChoice:
    """``tool_choice`` checked against the functions: "none", "auto", "required" or a named function
    (chat: {type: "function", function: {name}}; the Responses API, ``flat``: {type: "function",
    name}). Absent: "auto" with tools, "none" without."""
    if value is None:
        return ToolChoice("auto") if functions else NO_TOOLS
    if value in ("none", "auto", "required"):
        if value != "none" and not functions:
            raise bad_request(f"tool_choice '{value}' needs 'tools'", param="tool_choice")
        return ToolChoice(value)
    if not isinstance(value, Mapping) or value.get("type") != "function":
        raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", ...} "
                          "naming a function", param="tool_choice")
    if flat:
        name, param = value.get("name"), "tool_choice.name"
    else:
        function = value.get("function")
        name, param = (function.get("name") if isinstance(function, Mapping) else None), "tool_choice.function.name"
    if not functions:
        raise bad_request("A 'tool_choice' naming a function needs 'tools'", param="tool_choice")
    if not any(f.name == name for f in functions):
        raise bad_request(f"tool_choice names function {name!r:.80}, which is not in 'tools'", param=param)
    return ToolChoice("function", name)


# ---------------------------------------------------------------- history


def check_history(messages: Sequence[Mapping[str, Any]], params: Sequence[str]) -> None:
    """The history's calls: each ``arguments`` a JSON object's text, each call id unique and bounded,
    each tool result's ``tool_call_id`` naming an earlier call. ``params[i]`` names message i's field."""
    call_ids: set[str] = set()
    for i, message in enumerate(messages):
        for j, call in enumerate(message.get("tool_calls") or ()):
            param = f"{params[i]}.tool_calls[{j}]"
            call_id = call["id"]
            if not 0 < len(call_id) <= MAX_CALL_ID_CHARS:
                raise bad_request(f"'{param}.id' must be 1 to {MAX_CALL_ID_CHARS} characters", param=f"{param}.id")
            call_ids.add(call_id)
            try:
                arguments = json.loads(call["function"]["arguments"])
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):
                raise bad_request(f"'{param}.function.arguments' must be the JSON text of an object",
                                  param=f"{param}.function.arguments")
        if message.get("role") == "tool" and message.get("tool_call_id") not in call_ids:
            raise bad_request(f"tool_call_id {message.get('tool_call_id')!r:.80} matches no earlier tool call",
                              param=f"{params[i]}.tool_call_id")


# ---------------------------------------------------------------- the plan


async def tool_plan(engine: EngineClient, template: ChatTemplate | None, parser_setting: str,
                    functions: tuple[ToolFunction, ...], choice: ToolChoice, parallel: bool, *,
                    flat: bool = False) -> ToolPlan:
    """The request's plan: the parser (``--tool-call-parser``, or the template's family), and for a
    ``required`` or named choice the grammar spec, compiled once to check it (400 naming the tool
    whose parameters cannot be compiled: ``tools[i].function.parameters``, or ``tools[i].parameters``
    for the Responses API's ``flat`` tools)."""
    if not functions:
        return NO_PLAN
    parser: ParserName = (parser_for_template(template.source if template else None)
                          if parser_setting == "auto" else parser_setting)   # type: ignore[assignment]
    plan = ToolPlan(functions, choice, parallel, parser, None)
    if choice.mode not in ("required", "function"):
        return plan
    chosen = [f for f in functions if choice.mode == "required" or f.name == choice.name]
    spec = tool_calls_spec(chosen, parser, max_calls=plan.max_calls)
    await _check_compiles(engine, spec, functions, chosen, "" if flat else ".function")
    return replace(plan, spec=spec)


async def _check_compiles(engine: EngineClient, spec: StructuredSpec, functions: Sequence[ToolFunction],
                          chosen: Sequence[ToolFunction], nesting: str) -> None:
    from kvhive.engine.client import StructuredOutputError

    try:
        await engine.check_structured(spec)
    except StructuredOutputError as whole:
        # Which tool's parameters: each chosen one alone; else the spec as a whole.
        for function in chosen:
            try:
                await engine.check_structured(tool_calls_spec([function], "hermes", max_calls=1))
            except StructuredOutputError as exc:
                index = next(i for i, f in enumerate(functions) if f.name == function.name)
                raise bad_request(f"The parameters of tool '{function.name}' cannot be used: {exc.message}",
                                  param=f"tools[{index}]{nesting}.parameters") from None
        raise bad_request(f"The tools cannot be used: {whole.message}", param="tools") from None


def prompt_messages(template: ChatTemplate | None, messages: list[dict[str, Any]], plan: ToolPlan
                    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and the template variables that render them with the plan's tools
    (``kvhive.core.tool_formats.tool_prompt``)."""
    return tool_prompt(template, messages, plan.functions)
