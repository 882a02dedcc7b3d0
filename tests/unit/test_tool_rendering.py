"""Tool definitions and a history of calls and results rendered through each family's published chat
template exactly as transformers' ``apply_chat_template`` renders them (with the calls' arguments
parsed into objects, as vLLM passes them), and in kvhive's own format through a template without
tool support."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from support.tokenizer_families import FAMILIES, build_vocab, write_hf_dir

from kvhive.core.chat_template import ChatTemplate
from kvhive.core.tokenizer import Tokenizer
from kvhive.core.tool_formats import parser_for_template
from kvhive.server.tools import ToolChoice, ToolPlan, chat_functions, check_history, prompt_messages

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                        "units": {"enum": ["c", "f"]}},
                       "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
HISTORY = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_7f3a9c21b", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "units": "c"}'}}]},
    {"role": "tool", "tool_call_id": "call_7f3a9c21b", "content": '{"temp": 21}'},
]
# Each family's tool-call format, as picked from its template.
PARSER = {"llama3": "llama3_json", "mistral3": "mistral"}
# A ChatML template that never reads ``tools`` (SmolLM2's).
NO_TOOLS_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _plan(template: ChatTemplate | None) -> ToolPlan:
    return ToolPlan(chat_functions(TOOLS), ToolChoice("auto"), True,
                    parser_for_template(template.source if template else None), None)


@pytest.fixture(scope="module", params=["qwen3", "qwen2.5", "llama3", "mistral3"])
def family_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    family = next(f for f in FAMILIES if f.name == request.param)
    directory = tmp_path_factory.mktemp(f"tok-{family.name}")
    return family.name, write_hf_dir(family, build_vocab(family), directory)


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_history_renders_as_transformers_does(family_dir: tuple[str, str], generation_prompt: bool) -> None:
    from transformers import AutoTokenizer

    family, directory = family_dir
    ours = Tokenizer.from_hf_dir(directory)
    messages = copy.deepcopy(HISTORY)
    check_history(messages, [f"messages[{i}]" for i in range(len(messages))])
    rendered, variables = prompt_messages(ours.chat_template, messages, _plan(ours.chat_template))
    assert set(variables) == {"tools"}
    text = ours.apply_chat_template(rendered, add_generation_prompt=generation_prompt, **variables)

    # transformers over the same messages, each call's arguments given as an object.
    theirs = copy.deepcopy(HISTORY)
    theirs[2]["tool_calls"][0]["function"]["arguments"] = json.loads(
        theirs[2]["tool_calls"][0]["function"]["arguments"])
    expected = AutoTokenizer.from_pretrained(directory).apply_chat_template(
        theirs, tools=TOOLS, tokenize=False, add_generation_prompt=generation_prompt)
    assert text == expected
    assert "get_time" in text and '"city": "Paris"' in text and '{"temp": 21}' in text.replace('\\"', '"')
    assert parser_for_template(ours.chat_template.source) == PARSER.get(family, "hermes")


def test_template_without_tools_gets_kvhive_format() -> None:
    template = ChatTemplate(NO_TOOLS_TEMPLATE, {})
    assert not template.reads("tools")
    assert template.renders_role("tool")
    messages = copy.deepcopy(HISTORY)
    rendered, variables = prompt_messages(template, messages, _plan(template))
    assert variables == {}
    text = template.render(rendered)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nYou are terse.\n\n# Tools")
    for tool in TOOLS:
        assert json.dumps(tool) in system
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
            '"units": "c"}}\n</tool_call><|im_end|>') in text
    assert '<|im_start|>tool\n{"temp": 21}<|im_end|>' in text


@pytest.mark.parametrize("name", ["gemma-2-it.jinja", "mistral-7b-instruct-v0.1.jinja"])
def test_strict_alternation_gets_definitions_and_results_in_user_turns(name: str) -> None:
    # These templates raise for a system message and for turns that do not alternate user/assistant.
    source = (Path(__file__).resolve().parent.parent / "data" / "chat_templates" / name).read_text()
    template = ChatTemplate(source, {"bos_token": "<s>", "eos_token": "</s>"})
    assert not template.renders_role("tool") and not template.renders_role("system")
    history = copy.deepcopy(HISTORY[1:])
    rendered, _ = prompt_messages(template, history, _plan(template))
    assert [m["role"] for m in rendered] == ["user", "assistant", "user"]
    assert rendered[0]["content"].startswith("# Tools") and rendered[0]["content"].endswith("Weather in Paris?")
    assert rendered[-1]["content"] == '<tool_response>\n{"temp": 21}\n</tool_response>'
    text = template.render(rendered)
    assert "get_weather" in text and "<tool_call>" in text and "<tool_response>" in text


def test_history_without_tools_is_still_rendered() -> None:
    # Calls in the history of a request that offers no tools any more are not dropped.
    template = ChatTemplate(NO_TOOLS_TEMPLATE, {})
    plan = ToolPlan((), ToolChoice("none"), True, "hermes", None)
    rendered, _ = prompt_messages(template, copy.deepcopy(HISTORY), plan)
    text = template.render(rendered)
    assert "<tool_call>" in text and '{"temp": 21}' in text and "# Tools" not in text


@pytest.mark.parametrize(("messages", "param"), [
    ([{"role": "tool", "tool_call_id": "nope", "content": "x"}], "messages[0].tool_call_id"),
    ([{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}],
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}],
     "messages[0].tool_calls[0].function.arguments"),
])
def test_bad_history_names_the_field(messages: list[dict[str, Any]], param: str) -> None:
    from kvhive.server.errors import APIError

    with pytest.raises(APIError) as caught:
        check_history(messages, [f"messages[{i}]" for i in range(len(messages))])
    assert caught.value.status_code == 400 and caught.value.param == param
