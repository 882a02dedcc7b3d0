"""A request's tools checked into a plan: bad definitions and choices refused naming the field, the
grammar spec of forced calls per family, and one output read into content and calls (chat's message
and the Responses API's output items)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvhive.core.tool_formats import parser_for_template, tool_calls_spec
from kvhive.server.errors import APIError
from kvhive.server.responses_output import OutputItems
from kvhive.server.tool_output import read_whole
from kvhive.server.tools import (
    ToolChoice,
    ToolPlan,
    chat_functions,
    responses_functions,
    tool_choice,
)

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}


def refused(call: Any, *args: Any, **kwargs: Any) -> str | None:
    with pytest.raises(APIError) as caught:
        call(*args, **kwargs)
    assert caught.value.status_code == 400
    return caught.value.param


@pytest.mark.parametrize(("tools", "param"), [
    ([{"type": "code_interpreter"}], "tools[0].type"),
    (["get_weather"], "tools[0]"),
    ([{"type": "function"}], "tools[0].function"),
    ([{"type": "function", "function": {"name": "x" * 65}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "a.b"}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"enum": [1]}}}], "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100} for i in range(700)}}}}],
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "description": "x" * 20000}}], "tools[0].function.description"),
    ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], "tools[0].function.strict"),
    ([{"type": "function", "function": {"name": "f", "returns": {}}}], "tools[0].function.returns"),
    ([{"type": "function", "function": {"name": "f"}, "extra": 1}], "tools[0].extra"),
    ([TOOL, TOOL], "tools[1]"),
    ([{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)], "tools"),
])
def test_bad_chat_tools(tools: list[Any], param: str) -> None:
    assert refused(chat_functions, tools) == param


def test_chat_tools_accepted() -> None:
    (function,) = chat_functions([TOOL])
    assert function.name == "get_weather" and function.parameters == WEATHER and function.definition == TOOL
    (bare,) = chat_functions([{"type": "function", "function": {"name": "now", "parameters": {}}}])
    assert bare.parameters == {"type": "object", "properties": {}}


def test_responses_tools() -> None:
    (function,) = responses_functions([{"type": "function", "name": "get_weather", "parameters": WEATHER,
                                        "strict": True}])
    assert function.definition == {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                                                    "strict": True}}
    assert refused(responses_functions, [{"type": "file_search"}]) == "tools[0].type"
    assert refused(responses_functions, [{"type": "function", "name": "f", "parameters": 5}]) == "tools[0].parameters"


@pytest.mark.parametrize(("value", "flat", "param"), [
    ("required", False, None), ("sometimes", False, "tool_choice"),
    ({"type": "function", "function": {"name": "nope"}}, False, "tool_choice.function.name"),
    ({"type": "function", "name": "nope"}, True, "tool_choice.name"),
    ({"type": "allowed_tools"}, True, "tool_choice"),
])
def test_bad_tool_choice(value: Any, flat: bool, param: str | None) -> None:
    functions = chat_functions([TOOL])
    if param is None:
        assert refused(tool_choice, value, (), flat=flat) == "tool_choice"      # no tools
        return
    assert refused(tool_choice, value, functions, flat=flat) == param


def test_tool_choice_defaults_and_names() -> None:
    functions = chat_functions([TOOL])
    assert tool_choice(None, functions, flat=False) == ToolChoice("auto")
    assert tool_choice(None, (), flat=False) == ToolChoice("none")
    assert tool_choice("none", (), flat=False) == ToolChoice("none")
    assert tool_choice({"type": "function", "name": "get_weather"}, functions, flat=True) == ToolChoice(
        "function", "get_weather")


def test_forced_call_specs_per_family() -> None:
    functions = chat_functions([TOOL, {"type": "function", "function": {"name": "now"}}])
    hermes = tool_calls_spec(functions, "hermes", max_calls=None)
    schema = json.loads(hermes.schema)
    assert [list(option["properties"]) for option in schema["anyOf"]] == [["name", "arguments"]] * 2
    assert schema["anyOf"][0]["properties"]["arguments"] == WEATHER
    assert (hermes.tool_format.begin, hermes.tool_format.end) == ("<tool_call>\n", "\n</tool_call>")
    assert hermes.tool_format.max_calls is None and hermes.source == "tool_choice"
    llama = tool_calls_spec(functions[:1], "llama3_json", max_calls=1)
    assert list(json.loads(llama.schema)["properties"]) == ["name", "parameters"]
    assert llama.tool_format.begin == "" and llama.tool_format.max_calls == 1
    mistral = tool_calls_spec(functions, "mistral", max_calls=1)
    assert json.loads(mistral.schema)["type"] == "array" and json.loads(mistral.schema)["maxItems"] == 1
    assert mistral.tool_format.begin == "[TOOL_CALLS]"


def test_parser_from_template() -> None:
    assert parser_for_template(None) == "hermes"
    assert parser_for_template("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert parser_for_template("<|start_header_id|>ipython<|end_header_id|>") == "llama3_json"
    assert parser_for_template("<tool_call>") == "hermes"


def _plan(mode: str = "auto", parallel: bool = True, parser: str = "hermes") -> ToolPlan:
    return ToolPlan(chat_functions([TOOL]), ToolChoice(mode), parallel, parser, None)   # type: ignore[arg-type]


CALLS = ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>')


def test_one_output_read_into_content_and_calls() -> None:
    read = read_whole(_plan(), CALLS)
    assert read.content == "Sure." and [c.arguments_text for c in read.calls] == ['{"city": "Paris"}',
                                                                                   '{"city": "Lima"}']
    assert len({c.id for c in read.calls}) == 2 and all(c.id.startswith("call_") for c in read.calls)
    assert read.finish_reason("stop") == "tool_calls" and read.finish_reason("length") == "length"
    assert [c.arguments_text for c in read_whole(_plan(parallel=False), CALLS).calls] == ['{"city": "Paris"}']
    # tool_choice "none": the output is text, never read for calls.
    none = read_whole(_plan("none"), CALLS)
    assert none.calls == [] and none.content == CALLS and none.finish_reason("stop") == "stop"
    # Llama 3's template renders one call per assistant turn: one call is reported.
    assert _plan(parser="llama3_json").max_calls == 1


def test_responses_output_items_in_stream_and_whole_agree() -> None:
    streamed = OutputItems(_plan(), lambda tokens: [])
    kinds = [kind for kind, _ in streamed.start()]
    for piece in (CALLS[:9], CALLS[9:40], CALLS[40:]):
        kinds += [kind for kind, _ in streamed.add(piece, (), False)]
    kinds += [kind for kind, _ in streamed.finish()]
    assert kinds[:2] == ["response.output_item.added", "response.content_part.added"]
    assert kinds.count("response.output_item.added") == 3
    whole = OutputItems(_plan(), lambda tokens: [])
    whole.read_whole(CALLS)
    for items in (streamed.output("completed"), whole.output("completed")):
        assert [item.type for item in items] == ["message", "function_call", "function_call"]
        assert items[0].content[0].text == "Sure." and items[2].arguments == '{"city": "Lima"}'
    only_calls = OutputItems(_plan(), lambda tokens: [])
    only_calls.read_whole(CALLS.removeprefix("Sure.\n"))
    assert [item.type for item in only_calls.output("completed")] == ["function_call", "function_call"]
    done = streamed.done_events([item.model_dump() for item in streamed.output("completed")])
    assert [kind for kind, _ in done].count("response.function_call_arguments.done") == 2
