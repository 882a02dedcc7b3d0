"""A request's tools, checked once: the functions it offers, its ``tool_choice``, the history's calls
and results, and what that makes of the prompt, the grammar and the output parsing (``ToolPlan``).
Chat completions and the Responses API both build their plan here (``docs/tool_calling.md``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from kvhive.core import tool_definitions as definitions
from kvhive.core.json_body import BodyError
from kvhive.core.structured_spec import StructuredSpec
from kvhive.core.tool_formats import ToolFunction, parser_for_template, tool_calls_spec, tool_prompt
from kvhive.core.tool_parsers import PARSER_NAMES, ParserName
from kvhive.request import SamplingParams
from kvhive.server.errors import bad_request, body_error

if TYPE_CHECKING:
    from kvhive.core.chat_template import ChatTemplate
    from kvhive.engine.client import EngineClient

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
    """Chat completions' ``tools`` checked (``kvhive.core.tool_definitions.chat_functions``); 400
    naming the field that is wrong."""
    try:
        return definitions.chat_functions(tools)
    except BodyError as exc:
        raise body_error(exc) from None


def responses_functions(tools: Sequence[Any] | None) -> tuple[ToolFunction, ...]:
    """The Responses API's ``tools`` checked (``kvhive.core.tool_definitions.responses_functions``);
    400 naming the field that is wrong (other tool types are refused by name)."""
    try:
        return definitions.responses_functions(tools)
    except BodyError as exc:
        raise body_error(exc) from None


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
    """The history's calls and tool results checked (``kvhive.core.tool_definitions.check_history``);
    400 naming the field that is wrong."""
    try:
        definitions.check_history(messages, params)
    except BodyError as exc:
        raise body_error(exc) from None


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
