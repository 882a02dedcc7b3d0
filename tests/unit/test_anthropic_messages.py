"""Anthropic Messages bodies as chat parts (``kvhive.core.anthropic_messages``): the conversion of
system, messages, tools and tool_choice; and their cache breakpoints (``kvhive.core.anthropic_breakpoints``):
found and refused, and where each falls in the rendered prompt (always a true prefix of its token ids)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.tokenizer_families import family_tokenizer

from kvhive.core.anthropic_breakpoints import (
    MAX_BREAKPOINTS,
    breakpoint_chars,
    breakpoint_tokens,
    common_prefix_len,
    probe_body,
)
from kvhive.core.anthropic_messages import messages_chat, render_body, render_chat
from kvhive.core.json_body import BodyError
from kvhive.routing.prompts import Prompt, chat_text, messages_prompt

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"name": "get_weather", "description": "Weather in a city.", "input_schema": WEATHER}


def body(**fields: Any) -> dict[str, Any]:
    """A minimal valid body with ``fields`` replacing its parts."""
    return {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], **fields}


def ephemeral(ttl: str | None = None) -> dict[str, Any]:
    return {"type": "ephemeral"} if ttl is None else {"type": "ephemeral", "ttl": ttl}


ROUND_TRIP = body(
    tools=[{**TOOL, "cache_control": ephemeral("1h")}],
    system=[{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Be kind.",
                                                        "cache_control": ephemeral()}],
    messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                     {"type": "text", "text": "Thanks!", "cache_control": ephemeral()}]},
    ])


def refused(b: dict[str, Any]) -> BodyError:
    with pytest.raises(BodyError) as info:
        messages_chat(b)
    return info.value


# ---------------------------------------------------------------- conversion


def test_system_blocks_join_and_a_string_system_stays() -> None:
    chat = messages_chat(body(system=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]))
    assert chat.messages[0] == {"role": "system", "content": "a\nb"}
    assert messages_chat(body(system="s")).messages[0] == {"role": "system", "content": "s"}
    assert messages_chat(body()).messages == ({"role": "user", "content": "Hi"},)


def test_tool_use_and_tool_result_become_calls_and_tool_messages() -> None:
    chat = messages_chat(ROUND_TRIP)
    roles = [m["role"] for m in chat.messages]
    assert roles == ["system", "user", "assistant", "tool", "user"]
    assistant = chat.messages[2]
    assert assistant["content"] == "Checking."
    (call,) = assistant["tool_calls"]
    assert call == {"id": "toolu_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert chat.messages[3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}
    assert chat.tools == ({"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                                            "parameters": WEATHER}},)


def test_error_results_say_so() -> None:
    b = copy.deepcopy(ROUND_TRIP)
    b["messages"][2]["content"][0].update(is_error=True, content=[{"type": "text", "text": "no network"}])
    assert messages_chat(b).messages[3]["content"] == "Error: no network"


@pytest.mark.parametrize(("choice", "expected", "parallel"), [
    ({"type": "auto"}, "auto", True),
    ({"type": "any"}, "required", True),
    ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
    ({"type": "none"}, "none", True),
    ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}, True),
])
def test_tool_choice_maps_to_chat(choice: dict[str, Any], expected: Any, parallel: bool) -> None:
    chat = messages_chat(body(tools=[TOOL], tool_choice=choice))
    assert (chat.tool_choice, chat.parallel_tool_calls) == (expected, parallel)


@pytest.mark.parametrize(("change", "param"), [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "x", "name": "n"}]}, "messages[0].name"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "bold": True}]}]},
     "messages[0].content[0].bold"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "prefill "}]},
     "messages[1].content"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]}], "tools": [TOOL]},
     "messages[1].content"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope"}]}]},
     "messages[0].content[0].tool_use_id"),
    ({"tools": [{**TOOL, "name": "bad name"}]}, "tools[0].name"),
    ({"tools": [{**TOOL, "input_schema": {"type": "string"}}]}, "tools[0].input_schema"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [{**TOOL, "input_examples": []}]}, "tools[0].input_examples"),
    ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "other"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"system": [{"type": "text", "text": "s", "citations": [{"x": 1}]}]}, "system[0].citations"),
])
def test_bad_bodies_name_the_field(change: dict[str, Any], param: str) -> None:
    assert refused(body(**change)).param == param


# ---------------------------------------------------------------- breakpoints


def test_breakpoints_in_anthropic_order_with_ttls() -> None:
    chat = messages_chat(ROUND_TRIP)
    assert [(b.where, b.ttl_s) for b in chat.breakpoints] == [
        (("tools", 0), 3600), (("system", 1), 300), (("messages", 2, 1), 300)]


def test_top_level_cache_control_marks_the_last_block() -> None:
    chat = messages_chat(body(cache_control=ephemeral()))
    assert [b.where for b in chat.breakpoints] == [("messages", 0, None)]
    assert [b.where for b in messages_chat(ROUND_TRIP | {"cache_control": ephemeral()}).breakpoints][-1] == (
        "messages", 2, 1)


def test_a_text_inside_a_tool_result_breaks_after_the_result() -> None:
    b = copy.deepcopy(ROUND_TRIP)
    b["messages"][2]["content"][0]["content"] = [{"type": "text", "text": "sunny", "cache_control": ephemeral()}]
    assert ("messages", 2, 0) in [bp.where for bp in messages_chat(b).breakpoints]


@pytest.mark.parametrize(("control", "param"), [
    ({"type": "persistent"}, "system[0].cache_control.type"),
    ({"type": "ephemeral", "ttl": "10m"}, "system[0].cache_control.ttl"),
    ({"type": "ephemeral", "scope": "global"}, "system[0].cache_control.scope"),
    ("ephemeral", "system[0].cache_control"),
])
def test_bad_cache_control_is_refused(control: Any, param: str) -> None:
    assert refused(body(system=[{"type": "text", "text": "s", "cache_control": control}])).param == param


def test_more_than_four_breakpoints_are_refused() -> None:
    blocks = [{"type": "text", "text": f"t{i}", "cache_control": ephemeral()} for i in range(MAX_BREAKPOINTS + 1)]
    error = refused(body(system=blocks))
    assert "maximum of 4" in error.message and error.param == "system[4].cache_control"
    assert len(messages_chat(body(system=blocks[:MAX_BREAKPOINTS])).breakpoints) == MAX_BREAKPOINTS


def test_an_empty_text_block_cannot_carry_a_breakpoint() -> None:
    assert refused(body(system=[{"type": "text", "text": "", "cache_control": ephemeral()}])).param == (
        "system[0].cache_control")


def test_a_longer_ttl_after_a_shorter_one_is_refused() -> None:
    blocks = [{"type": "text", "text": "a", "cache_control": ephemeral("5m")},
              {"type": "text", "text": "b", "cache_control": ephemeral("1h")}]
    assert refused(body(system=blocks)).param == "system[1].cache_control"


def placed(tokenizer: Any, b: dict[str, Any]) -> tuple[str, list[int], list[int], list[int]]:
    chat = messages_chat(b)
    text, offsets = breakpoint_chars(b, chat.breakpoints, lambda body: render_body(tokenizer, body))
    ids = tokenizer.encode(text)
    return text, offsets, ids, breakpoint_tokens(tokenizer.encode, text, ids, offsets)


def test_breakpoints_end_at_their_block_and_are_true_prefixes(tokenizer: Any) -> None:
    text, offsets, ids, counts = placed(tokenizer, ROUND_TRIP)
    assert offsets == sorted(offsets) and counts == sorted(counts)
    # The tools render after the system text here: both breakpoints cover the system and the tool.
    assert text[:offsets[0]].rstrip().endswith('"description": "Weather in a city.", "parameters": '
                                                '{"type": "object", "properties": {"city": {"type": "string"}}, '
                                                '"required": ["city"]}}}')
    assert "Be kind." in text[:offsets[1]] and "Weather in Paris" not in text[:offsets[1]]
    assert text[:offsets[2]].endswith("Thanks!<|im_end|>\n<|im_start|>assistant\n")
    assert counts[2] == len(ids)
    for count, offset in zip(counts, offsets, strict=True):
        assert 0 < count <= len(ids)
        assert text[:offset].startswith(tokenizer.decode(ids[:count], skip_special_tokens=False))


def test_a_breakpoint_before_the_last_turn_excludes_it(tokenizer: Any) -> None:
    b = copy.deepcopy(ROUND_TRIP)
    b["messages"][2]["content"][1].pop("cache_control")
    b["messages"][0] = {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?",
                                                     "cache_control": ephemeral()}]}
    text, offsets, ids, counts = placed(tokenizer, b)
    assert "Weather in Paris?<|im_end|>" in text[:offsets[-1]] and "Checking." not in text[:offsets[-1]]
    assert counts[-1] < len(ids)
    # The next turn's prompt starts with the same ids up to the breakpoint.
    longer = copy.deepcopy(b)
    longer["messages"] += [{"role": "assistant", "content": "You're welcome."}, {"role": "user", "content": "Bye"}]
    longer_ids = tokenizer.encode(render_chat(tokenizer, messages_chat(longer)))
    assert longer_ids[:counts[-1]] == ids[:counts[-1]]


@pytest.fixture(scope="module", params=["qwen3", "llama3", "default"])
def template_tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Templates that render tools themselves (qwen3, llama3) and one that does not (kvhive's format)."""
    return family_tokenizer(request.param, tmp_path_factory.mktemp(request.param))


def test_every_template_places_each_breakpoint_after_its_block(template_tokenizer: Any) -> None:
    b = copy.deepcopy(ROUND_TRIP)
    b["messages"][2]["content"][1].pop("cache_control")
    b["messages"][0] = {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?",
                                                     "cache_control": ephemeral()}]}
    text, offsets, ids, counts = placed(template_tokenizer, b)
    assert offsets == sorted(offsets) and counts == sorted(counts) and 0 < counts[0] and counts[-1] < len(ids)
    assert '"get_weather"' in text[:offsets[0]] and "Be kind." in text[:offsets[1]]
    assert "Weather in Paris?" in text[:offsets[2]] and "Checking." not in text[:offsets[2]]
    # The gateway renders the same text (its chat path), so it finds the same breakpoints.
    chat = messages_chat(b)
    assert text == chat_text(template_tokenizer, Prompt(messages=chat.messages, tools=chat.tools))
    # The next turn's prompt starts with the breakpointed ids.
    longer = copy.deepcopy(b)
    longer["messages"] += [{"role": "assistant", "content": "Glad to help."}, {"role": "user", "content": "Bye"}]
    longer_ids = template_tokenizer.encode(render_chat(template_tokenizer, messages_chat(longer)))
    assert longer_ids[:counts[-1]] == ids[:counts[-1]]


def test_a_breakpoint_on_the_system_alone_covers_the_tools(template_tokenizer: Any) -> None:
    """Anthropic caches tools and system together: a system breakpoint with no tools breakpoint
    still covers the tool definitions, wherever the template writes them."""
    b = copy.deepcopy(ROUND_TRIP)
    b["tools"] = [TOOL]
    b["messages"][2]["content"][1].pop("cache_control")
    text, offsets, ids, counts = placed(template_tokenizer, b)
    assert len(offsets) == 1
    assert '"get_weather"' in text[:offsets[0]] and "Be kind." in text[:offsets[0]]
    assert "Checking." not in text[:offsets[0]] and counts[0] < len(ids)


def test_consecutive_turns_of_one_role_are_combined() -> None:
    chat = messages_chat(body(messages=[{"role": "user", "content": "a"}, {"role": "user", "content": [
        {"type": "text", "text": "b"}]}, {"role": "assistant", "content": "c"}, {"role": "user", "content": "d"}]))
    assert [(m["role"], m["content"]) for m in chat.messages] == [("user", "a\nb"), ("assistant", "c"), ("user", "d")]
    # A tool result and the text after it stay apart.
    assert [m["role"] for m in messages_chat(ROUND_TRIP).messages] == ["system", "user", "assistant", "tool", "user"]


def test_probes_change_only_what_follows_the_block() -> None:
    # A user tool named like the sentinel tool does not clash with it.
    tools = [{**TOOL, "name": "kvhive_cache_breakpoint_0", "cache_control": ephemeral()}]
    b = body(tools=tools, tool_choice={"type": "any"})
    probe = probe_body(b, ("tools", 0))
    assert [t["name"] for t in probe["tools"]] == ["kvhive_cache_breakpoint_0", "kvhive_cache_breakpoint_1"]
    assert "tool_choice" not in probe and messages_chat(probe).tools
    # A message cut after an assistant block is followed by a user turn (the body stays servable).
    cut = probe_body(ROUND_TRIP, ("messages", 1, 0))
    assert cut["messages"][1]["content"] == [{"type": "text", "text": "Checking."}]
    assert cut["messages"][-1]["role"] == "user" and len(cut["messages"]) == 3
    messages_chat(cut)
    assert "cache_control" not in probe_body(ROUND_TRIP | {"cache_control": ephemeral()}, ("system", 1))


@given(st.text(alphabet="ab", max_size=40), st.text(alphabet="ab", max_size=40))
def test_common_prefix_len(a: str, b: str) -> None:
    n = common_prefix_len(a, b)
    assert a[:n] == b[:n] and (n == min(len(a), len(b)) or a[n] != b[n])
    assert common_prefix_len(list(a), list(b)) == n


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.sampled_from(
    ["text", "tool_use", "tool_result", "user", "assistant", "system", "ephemeral", "5m", "1h", "any", "tool", "a"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(
        ["type", "text", "role", "content", "id", "name", "input", "tool_use_id", "cache_control", "ttl",
         "input_schema", "is_error", "disable_parallel_tool_use", "x"]), inner, max_size=5), max_leaves=25)


CACHE_CONTROL = st.none() | st.fixed_dictionaries({"type": st.sampled_from(["ephemeral", "x"])},
                                                   optional={"ttl": st.sampled_from(["5m", "1h", "2h"])})
TEXT_BLOCK = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=4)},
                                   optional={"cache_control": CACHE_CONTROL})
BLOCK = st.fixed_dictionaries({"type": st.sampled_from(["text", "tool_use", "tool_result", "image"])}, optional={
    "text": st.text(max_size=4), "id": st.sampled_from(["t1", "t2"]), "name": st.sampled_from(["f", "g"]),
    "input": st.dictionaries(st.text(max_size=2), st.integers(), max_size=2), "tool_use_id": st.sampled_from(["t1", "t2"]),
    "content": st.text(max_size=3) | st.lists(TEXT_BLOCK, max_size=2), "cache_control": CACHE_CONTROL})
MESSAGES_BODY = st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["user", "assistant", "system"]),
    "content": st.text(max_size=4) | st.lists(BLOCK, max_size=3)}), min_size=1, max_size=4)}, optional={
    "system": st.text(max_size=4) | st.lists(TEXT_BLOCK, max_size=3),
    "tools": st.lists(st.fixed_dictionaries({"name": st.sampled_from(["f", "g", "bad name"]),
                                             "input_schema": st.just({"type": "object"})},
                                            optional={"cache_control": CACHE_CONTROL}), max_size=2),
    "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none"])},
                                         optional={"name": st.sampled_from(["f", "g"])}),
    "cache_control": CACHE_CONTROL})
ANY_BODY = st.fixed_dictionaries({}, optional={"messages": JSON, "system": JSON, "tools": JSON, "tool_choice": JSON,
                                               "cache_control": JSON})


@settings(max_examples=300)
@given(raw=st.one_of(MESSAGES_BODY, ANY_BODY))
def test_any_body_converts_or_is_refused_by_name(tokenizer: Any, raw: dict[str, Any]) -> None:
    try:
        chat = messages_chat(raw)
    except BodyError as exc:
        assert exc.message
        return
    assert chat.messages and len(chat.breakpoints) <= MAX_BREAKPOINTS
    # Every body that converts renders, and its breakpoints fall in order inside its prompt.
    text, offsets, ids, counts = placed(tokenizer, raw)
    assert counts == sorted(counts) and all(0 < n <= len(ids) for n in counts)


def test_a_last_assistant_message_is_a_prefill_the_answer_goes_on_from(template_tokenizer: Any) -> None:
    b = copy.deepcopy(ROUND_TRIP)
    b["messages"][2]["content"][1].pop("cache_control")
    b["messages"][0] = {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?",
                                                     "cache_control": ephemeral()}]}
    b["messages"].append({"role": "assistant", "content": [{"type": "text", "text": "In Paris it is"}]})
    chat = messages_chat(b)
    assert chat.prefill and not messages_chat(ROUND_TRIP).prefill
    text, offsets, ids, counts = placed(template_tokenizer, b)
    assert text.endswith("In Paris it is")                     # left open: no end of turn after it
    assert "Weather in Paris?" in text[:offsets[-1]] and "In Paris it is" not in text[:offsets[-1]]
    assert 0 < counts[-1] < len(ids)
    # The gateway renders the same prompt (its Anthropic path).
    assert text == chat_text(template_tokenizer, messages_prompt(b))
