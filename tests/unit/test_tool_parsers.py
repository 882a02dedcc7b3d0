"""The tool-call parsers of each family: whole outputs split into content and calls, the same calls
and content however the output is chunked, and no call markup leaking into the content."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhive.core.tool_parsers import (
    ContentDelta,
    ParsedCall,
    ParsedOutput,
    collect,
    new_parser,
    parse_whole,
)

WEATHER = '{"city": "Paris", "units": ["c", "f"], "note": "a } in \\" a string"}'
CASES = [
    ("hermes", f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
     "Let me check.", [ParsedCall("get_weather", WEATHER)]),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n'
               '{"name": "b", "arguments": {"x": 1}}\n</tool_call>', "",
     [ParsedCall("a", "{}"), ParsedCall("b", '{"x": 1}')]),
    ("hermes", '<tool_call>{"arguments": {"x": [1, {"y": 2}]}, "name": "late"}</tool_call>', "",
     [ParsedCall("late", '{"x": [1, {"y": 2}]}')]),
    ("hermes", '<tool_call>{"name": "s", "arguments": "{\\"q\\": 1}"}</tool_call>', "", [ParsedCall("s", '{"q": 1}')]),
    ("hermes", '<tool_call>{"name": "bare"}</tool_call>', "", [ParsedCall("bare", "{}")]),
    ("hermes", "No call here: 1 < 2 and <tool> is not a marker.", "No call here: 1 < 2 and <tool> is not a marker.", []),
    ("hermes", 'A <tool_call>{"nome": 1}</tool_call>', 'A <tool_call>{"nome": 1}', []),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}}', "", [ParsedCall("f", '{"a": 1}')]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}', "",
     [ParsedCall("f", '{"a": 1}'), ParsedCall("g", "{}")]),
    ("llama3_json", "The answer is {x}.", "The answer is {x}.", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {"b": "]"}}]',
     "Sure.", [ParsedCall("f", '{"a": 1}'), ParsedCall("g", '{"b": "]"}')]),
    ("mistral", "[TOOLS] is not [TOOL_CALL", "[TOOLS] is not [TOOL_CALL", []),
    ("mistral", ' [{"name": "f", "arguments": {"a": [1]}}]', "", [ParsedCall("f", '{"a": [1]}')]),
    ("mistral", "[1, 2] is a list; [{x}]", "[1, 2] is a list; [{x}]", []),
    ("mistral", "[", "[", []),
    ("mistral", '[{"a": 1}] ok', '[{"a": 1}] ok', []),
]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_whole_output(parser: str, text: str, content: str, calls: list[ParsedCall]) -> None:
    parsed = parse_whole(parser, text)
    assert parsed == ParsedOutput(content, calls)
    for call in parsed.calls:
        assert isinstance(json.loads(call.arguments), dict)


def _chunked(parser_name: str, text: str, cuts: list[int]) -> tuple[ParsedOutput, list[str]]:
    parser = new_parser(parser_name)
    events = []
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    for start, end in zip(bounds, bounds[1:], strict=False):
        events += parser.feed(text[start:end])
    events += parser.finish()
    return collect(events), [e.text for e in events if isinstance(e, ContentDelta)]


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=40))
def test_any_chunking_gives_the_same_calls(case: tuple, cuts: list[int]) -> None:
    parser, text, content, calls = case
    parsed, _ = _chunked(parser, text, cuts)
    assert parsed == ParsedOutput(content, calls)


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=40))
def test_no_markup_leaks_into_streamed_content(cuts: list[int]) -> None:
    text = 'Checking.\n<tool_call>\n{"name": "f", "arguments": {"a": "<tool_call>"}}\n</tool_call>'
    _, content = _chunked("hermes", text, cuts)
    assert "".join(content) == "Checking."
    assert all("<" not in piece for piece in content)


@settings(max_examples=40, deadline=None)
@given(prose=st.text(alphabet="ab <>{}[]\"_\n", max_size=60), cuts=st.lists(st.integers(0, 100), max_size=20))
def test_text_without_markers_is_content(prose: str, cuts: list[int]) -> None:
    # Hermes text with no marker is all content, whatever braces and brackets it holds.
    if "<tool_call>" in prose:
        return
    parsed, _ = _chunked("hermes", prose, cuts)
    assert parsed.calls == []
    assert parsed.content == prose


def test_arguments_stream_as_they_are_written() -> None:
    parser = new_parser("hermes")
    events = parser.feed('<tool_call>\n{"name": "f", "arguments": {"a": ')
    assert [type(e).__name__ for e in events] == ["CallStarted", "ArgumentsDelta"]
    more = parser.feed('"xy')
    assert [e.text for e in more] == [' "xy']


def test_truncated_call_keeps_what_was_written() -> None:
    parsed = parse_whole("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": "tr')
    assert parsed.calls == [ParsedCall("f", '{"a": "tr')]
    assert parsed.content == ""


def test_each_argument_character_is_sent_once() -> None:
    # A long argument string streamed one character at a time: the deltas add up to the arguments.
    text = '<tool_call>{"name": "f", "arguments": {"a": "' + "x" * 20000 + '"}}</tool_call>'
    parser = new_parser("hermes")
    sent = []
    for char in text:
        sent += parser.feed(char)
    sent += parser.finish()
    parsed = collect(sent)
    assert len(parsed.calls[0].arguments) == 20000 + 9
    assert sum(len(getattr(e, "text", "")) for e in sent) == len(parsed.calls[0].arguments)


NAMES = st.from_regex(r"[a-zA-Z0-9_-]{1,12}", fullmatch=True)
ARGUMENTS = st.dictionaries(st.text(max_size=8), st.one_of(st.integers(), st.text(max_size=10), st.booleans(),
                                                            st.lists(st.integers(), max_size=3)), max_size=4)


@settings(max_examples=80, deadline=None)
@given(parser=st.sampled_from(["hermes", "llama3_json", "mistral"]),
       calls=st.lists(st.tuples(NAMES, ARGUMENTS), min_size=1, max_size=3),
       prose=st.text(alphabet="abc .,!?\n", max_size=30).map(str.strip),
       cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=30))
def test_written_calls_are_read_back(parser: str, calls: list[tuple[str, dict]], prose: str, cuts: list[int]) -> None:
    # Calls as each family writes them (after some text where the format allows it), in any chunking.
    from kvhive.core.tool_formats import call_text

    if parser == "llama3_json":
        text, prose = "; ".join(call_text(n, a, "llama3_json") for n, a in calls), ""
    elif parser == "mistral":
        body = ", ".join(json.dumps({"name": n, "arguments": a}, ensure_ascii=False) for n, a in calls)
        text = f"{prose}[TOOL_CALLS][{body}]"
    else:
        text = prose + "\n" + "\n".join(call_text(n, a) for n, a in calls)
    parsed, _ = _chunked(parser, text, cuts)
    assert parsed.content == prose
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_output_nested_past_the_json_parsers_stack_is_read_without_error(parser: str) -> None:
    """A model that writes arrays nested deeper than Python's JSON parser recurses (a degenerate
    loop) gets its output read as a parser reads any other: no exception, a call's arguments text
    as written."""
    deep = "[" * 5000 + "]" * 5000
    text = {"hermes": f'<tool_call>{{"name": "f", "arguments": {deep}}}</tool_call>',
            "llama3_json": f'{{"name": "f", "parameters": {deep}}}',
            "mistral": f'[TOOL_CALLS][{{"name": "f", "arguments": {deep}}}]'}[parser]
    parsed = parse_whole(parser, text)
    assert all(call.arguments in (deep, "{}") for call in parsed.calls)
    assert parse_whole(parser, deep + " and " + deep) is not None
