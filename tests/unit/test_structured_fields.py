"""A request's structured-output fields as one StructuredSpec (``kvhive.server.structured``): every
form each endpoint takes, the canonical schema text, the bounds, and the 400 naming the field for
each malformed form, second constraint, or schema the grammar backend refuses."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import pytest

from kvhive.core.generation_defaults import NO_DEFAULTS
from kvhive.core.structured_spec import StructuredSpec
from kvhive.server.chat_protocol import ChatCompletionRequest
from kvhive.server.errors import APIError
from kvhive.server.protocol import CompletionRequest
from kvhive.server.responses_protocol import ResponsesRequest, check_unsupported
from kvhive.server.sampling_fields import sampling_params_for
from kvhive.server.structured import (
    MAX_CHOICE_CHARS,
    MAX_CHOICE_OPTIONS,
    MAX_GRAMMAR_CHARS,
    MAX_PATTERN_CHARS,
    MAX_SCHEMA_CHARS,
    MAX_SCHEMA_DEPTH,
    body_structured_spec,
    check_format_with_tools,
    checked_spec,
    requested_output,
    text_format_output,
    text_structured_spec,
)
from kvhive.structured.errors import StructuredOutputError

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string", "maxLength": 8}},
          "required": ["a", "b"], "additionalProperties": False}
CANONICAL = json.dumps(SCHEMA, sort_keys=True, separators=(",", ":"))
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 **fields})


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})


def spec_of(body: Any) -> tuple[StructuredSpec, str] | None:
    requested = requested_output(body)
    return None if requested is None else (requested.spec, requested.param)


def refusal(fn: Any, *args: Any) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args)
    assert info.value.status_code == 400 and info.value.type == "invalid_request_error"
    return info.value


def refused_param(body: Any) -> str | None:
    return refusal(requested_output, body).param


# ---------------------------------------------------------------- each form -> its spec


@pytest.mark.parametrize("make", [chat, completion])
def test_response_format_forms(make: Any) -> None:
    assert spec_of(make()) is None
    assert spec_of(make(response_format={"type": "text"})) is None
    assert spec_of(make(response_format={"type": "json_object"})) == (
        StructuredSpec("json_object", source="response_format"), "response_format")
    fmt = {"type": "json_schema", "json_schema": {"name": "answer_1", "schema": SCHEMA, "strict": True,
                                                  "description": "An answer."}}
    assert spec_of(make(response_format=fmt)) == (
        StructuredSpec("json_schema", schema=CANONICAL, source="response_format"),
        "response_format.json_schema.schema")


def test_schema_is_canonical_so_equal_schemas_share_a_spec() -> None:
    reordered = {"required": ["a", "b"], "additionalProperties": False,
                 "properties": {"a": {"maxLength": 8, "type": "string"}, "b": {"type": "integer"}}, "type": "object"}
    first = requested_output(chat(response_format={"type": "json_schema",
                                                   "json_schema": {"name": "x", "schema": SCHEMA}}))
    second = requested_output(chat(response_format={"type": "json_schema",
                                                    "json_schema": {"name": "y", "schema": reordered, "strict": False}}))
    assert first is not None and second is not None
    assert first.spec == second.spec and hash(first.spec) == hash(second.spec)
    assert first.spec.schema == CANONICAL and " " not in CANONICAL


def test_non_ascii_schema_text_kept() -> None:
    schema = {"enum": ["café", "日本"]}
    requested = requested_output(chat(guided_json=schema))
    assert requested is not None and json.loads(requested.spec.schema) == schema and "café" in requested.spec.schema


@pytest.mark.parametrize("make", [chat, completion])
def test_structured_outputs_forms(make: Any) -> None:
    so = "structured_outputs"
    assert spec_of(make(structured_outputs={"json": SCHEMA})) == (
        StructuredSpec("json_schema", schema=CANONICAL, source=so), "structured_outputs.json")
    assert spec_of(make(structured_outputs={"json": json.dumps(SCHEMA, indent=2)}))[0].schema == CANONICAL
    assert spec_of(make(structured_outputs={"regex": r"\d{3}"})) == (
        StructuredSpec("regex", pattern=r"\d{3}", source=so), "structured_outputs.regex")
    assert spec_of(make(structured_outputs={"choice": ["yes", "no"]})) == (
        StructuredSpec("choice", choices=("yes", "no"), source=so), "structured_outputs.choice")
    assert spec_of(make(structured_outputs={"grammar": 'start: "a"+'})) == (
        StructuredSpec("grammar", grammar='start: "a"+', source=so), "structured_outputs.grammar")
    assert spec_of(make(structured_outputs={"json_object": True})) == (
        StructuredSpec("json_object", source=so), "structured_outputs.json_object")


def test_structured_outputs_options_at_the_backends_own_values_are_accepted() -> None:
    body = chat(structured_outputs={"choice": ["a"], "disable_fallback": True, "disable_any_whitespace": False,
                                    "disable_additional_properties": False, "whitespace_pattern": None,
                                    "structural_tag": None})
    assert spec_of(body)[0].kind == "choice"
    assert spec_of(chat(structured_outputs={"choice": ["a"], "disable_fallback": False}))[0].kind == "choice"


@pytest.mark.parametrize("make", [chat, completion])
def test_guided_fields(make: Any) -> None:
    assert spec_of(make(guided_json=SCHEMA)) == (
        StructuredSpec("json_schema", schema=CANONICAL, source="guided_json"), "guided_json")
    assert spec_of(make(guided_json=json.dumps(SCHEMA)))[0].schema == CANONICAL
    assert spec_of(make(guided_regex="[a-z]+")) == (StructuredSpec("regex", pattern="[a-z]+", source="guided_regex"),
                                                    "guided_regex")
    assert spec_of(make(guided_choice=["x", "y"])) == (
        StructuredSpec("choice", choices=("x", "y"), source="guided_choice"), "guided_choice")
    assert spec_of(make(guided_grammar='start: "x"')) == (
        StructuredSpec("grammar", grammar='start: "x"', source="guided_grammar"), "guided_grammar")
    for backend in ("auto", "guidance", "llguidance"):
        assert spec_of(make(guided_regex="a", guided_decoding_backend=backend))[0].kind == "regex"


def test_responses_text_format_forms() -> None:
    assert text_format_output(None) is None
    assert text_format_output({"verbosity": "medium"}) is None
    assert text_format_output({"format": {"type": "text"}}) is None
    json_object = text_format_output({"format": {"type": "json_object"}})
    assert json_object is not None and json_object.spec == StructuredSpec("json_object", source="text.format")
    schema = text_format_output({"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA,
                                            "strict": True, "description": "d"}})
    assert schema is not None and schema.param == "text.format.schema"
    assert schema.spec == StructuredSpec("json_schema", schema=CANONICAL, source="text.format")
    body = ResponsesRequest.model_validate({"model": "m", "input": "hi",
                                            "text": {"format": {"type": "json_object"}, "verbosity": "medium"}})
    check_unsupported(body)                     # a format is no longer refused there
    with pytest.raises(APIError) as info:
        check_unsupported(ResponsesRequest.model_validate({"model": "m", "input": "hi", "text": {"verbosity": "low"}}))
    assert info.value.param == "text.verbosity"


# ---------------------------------------------------------------- bad forms -> 400 naming the field


@pytest.mark.parametrize(("response_format", "param"), [
    ({}, "response_format.type"),
    ({"type": "xml"}, "response_format.type"),
    ({"type": "text", "extra": 1}, "response_format.extra"),
    ({"type": "json_object", "schema": SCHEMA}, "response_format.schema"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": "x"}, "response_format.json_schema"),
    ({"type": "json_schema", "schema": SCHEMA}, "response_format.schema"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "n" * 65, "schema": SCHEMA}},
     "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "n"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": [1]}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": "{}"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": "yes"}},
     "response_format.json_schema.strict"),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "description": 3}},
     "response_format.json_schema.description"),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "other": 1}},
     "response_format.json_schema.other"),
])
def test_malformed_response_format(response_format: dict[str, Any], param: str) -> None:
    assert refused_param(chat(response_format=response_format)) == param


@pytest.mark.parametrize(("fmt", "param"), [
    ({}, "text.format.type"),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}, "text.format.json_schema"),
    ({"type": "json_schema", "name": "n"}, "text.format.schema"),
    ({"type": "json_schema", "schema": SCHEMA}, "text.format.name"),
    ({"type": "json_object", "strict": True}, "text.format.strict"),
    ({"type": "grammar"}, "text.format.type"),
    ("json", "text.format"),
])
def test_malformed_text_format(fmt: Any, param: str) -> None:
    assert refusal(text_format_output, {"format": fmt}).param == param


@pytest.mark.parametrize(("structured_outputs", "param"), [
    ({}, "structured_outputs"),
    ({"json": SCHEMA, "regex": "a"}, "structured_outputs.regex"),
    ({"structural_tag": '{"type": "structural_tag"}'}, "structured_outputs.structural_tag"),
    ({"regex": "a", "whitespace_pattern": " "}, "structured_outputs.whitespace_pattern"),
    ({"json": SCHEMA, "disable_any_whitespace": True}, "structured_outputs.disable_any_whitespace"),
    ({"json": SCHEMA, "disable_additional_properties": True}, "structured_outputs.disable_additional_properties"),
    ({"regex": "a", "disable_fallback": "no"}, "structured_outputs.disable_fallback"),
    ({"regex": "a", "backend": "xgrammar"}, "structured_outputs.backend"),
    ({"json_object": False}, "structured_outputs.json_object"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"json": "[1, 2]"}, "structured_outputs.json"),
    ({"json": '{"a": NaN}'}, "structured_outputs.json"),
    ({"regex": ""}, "structured_outputs.regex"),
    ({"regex": 5}, "structured_outputs.regex"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": "yes"}, "structured_outputs.choice"),
    ({"choice": ["yes", ""]}, "structured_outputs.choice[1]"),
    ({"choice": ["yes", 1]}, "structured_outputs.choice[1]"),
])
def test_malformed_structured_outputs(structured_outputs: dict[str, Any], param: str) -> None:
    assert refused_param(completion(structured_outputs=structured_outputs)) == param


def test_guided_options_that_would_change_the_output_are_refused() -> None:
    assert refused_param(chat(guided_json=SCHEMA, guided_whitespace_pattern=r"[ ]?")) == "guided_whitespace_pattern"
    assert refused_param(chat(guided_regex="a", guided_decoding_backend="outlines")) == "guided_decoding_backend"
    assert refused_param(chat(guided_choice=[])) == "guided_choice"


@pytest.mark.parametrize(("fields", "param"), [
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
])
def test_two_constraints_refused(fields: dict[str, Any], param: str) -> None:
    error = refusal(requested_output, chat(**fields))
    assert error.param == param and "only one" in error.message


def test_text_response_format_is_no_second_constraint() -> None:
    assert spec_of(chat(response_format={"type": "text"}, guided_regex="a"))[0].kind == "regex"


# ---------------------------------------------------------------- bounds


def deep_schema(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


def test_schema_size_bound() -> None:
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "d" * 1000}
                                            for i in range(1000)}}                  # ~1 MB
    param = "response_format.json_schema.schema"
    error = refusal(requested_output, chat(response_format={"type": "json_schema",
                                                            "json_schema": {"name": "big", "schema": big}}))
    assert error.param == param and str(MAX_SCHEMA_CHARS) in error.message
    assert refused_param(chat(guided_json=json.dumps(big))) == "guided_json"      # refused before parsing
    fits = {"enum": ["x" * (MAX_SCHEMA_CHARS - 20)]}
    assert spec_of(chat(guided_json=fits)) is not None


def test_schema_depth_bound() -> None:
    # Each object level is two JSON levels (the schema, then its "properties").
    levels = MAX_SCHEMA_DEPTH // 2
    assert spec_of(chat(structured_outputs={"json": deep_schema(levels - 1)})) is not None
    assert refused_param(chat(structured_outputs={"json": json.dumps(deep_schema(levels + 1))})) == \
        "structured_outputs.json"
    # Deeper than Python's parser recursion: the text is refused, not a crash.
    assert refused_param(chat(guided_json="[" * 100_000)) == "guided_json"


def test_text_bounds() -> None:
    assert spec_of(chat(guided_regex="a" * MAX_PATTERN_CHARS)) is not None
    assert refused_param(chat(guided_regex="a" * (MAX_PATTERN_CHARS + 1))) == "guided_regex"
    assert refused_param(chat(guided_grammar="a" * (MAX_GRAMMAR_CHARS + 1))) == "guided_grammar"
    assert spec_of(chat(guided_choice=[str(i) for i in range(MAX_CHOICE_OPTIONS)])) is not None
    assert refused_param(chat(guided_choice=[str(i) for i in range(MAX_CHOICE_OPTIONS + 1)])) == "guided_choice"
    half = "x" * (MAX_CHOICE_CHARS // 2)
    assert refused_param(chat(guided_choice=[half, half, "y"])) == "guided_choice"


# ---------------------------------------------------------------- tools, the compile check, sampling


@dataclass(frozen=True)
class NamedChoice:
    """A ``tool_choice`` as a request model may hold it: an object with attributes."""

    type: str = "function"
    name: str = "get_weather"


def test_format_with_a_forced_tool_call_refused() -> None:
    requested = requested_output(chat(response_format={"type": "json_object"}))
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}},
                   {"type": "function", "name": "get_weather"}, NamedChoice(),
                   {"type": "allowed_tools", "mode": "required", "tools": []}):
        assert refusal(check_format_with_tools, requested, TOOLS, choice).param == "response_format"
    for choice in (None, "auto", "none", {"type": "allowed_tools", "mode": "auto", "tools": []}):
        check_format_with_tools(requested, TOOLS, choice)
    check_format_with_tools(requested, None, "required")       # no tools: not this check's to refuse
    check_format_with_tools(None, TOOLS, "required")


class FakeEngine:
    """Records the specs it was asked to compile; refuses those whose text holds ``bad``."""

    def __init__(self) -> None:
        self.checked: list[StructuredSpec] = []

    async def check_structured(self, spec: StructuredSpec) -> None:
        self.checked.append(spec)
        if "bad" in (spec.schema or spec.pattern or spec.grammar or ""):
            raise StructuredOutputError("the grammar library says no", param=spec.source)


def test_compile_refusal_names_the_field() -> None:
    engine = FakeEngine()
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"$ref": "#/bad"}}}
    with pytest.raises(APIError) as info:
        asyncio.run(body_structured_spec(engine, chat(response_format=fmt)))
    assert info.value.status_code == 400 and info.value.param == "response_format.json_schema.schema"
    assert "the grammar library says no" in info.value.message
    with pytest.raises(APIError) as info:
        asyncio.run(text_structured_spec(engine, {"format": {"type": "json_schema", "name": "n",
                                                             "schema": {"$ref": "#/bad"}}}, None, None))
    assert info.value.param == "text.format.schema"
    good = asyncio.run(body_structured_spec(engine, completion(guided_regex="[0-9]+")))
    assert good == StructuredSpec("regex", pattern="[0-9]+", source="guided_regex") == engine.checked[-1]


def test_no_fields_no_compile() -> None:
    engine = FakeEngine()
    assert asyncio.run(body_structured_spec(engine, chat())) is None
    assert asyncio.run(body_structured_spec(engine, chat(response_format={"type": "text"}))) is None
    assert asyncio.run(text_structured_spec(engine, {"verbosity": "medium"}, None, None)) is None
    assert asyncio.run(checked_spec(engine, None)) is None
    assert engine.checked == []


def test_chat_body_forcing_a_tool_call_with_a_format_refused() -> None:
    body = chat(response_format={"type": "json_object"}, tools=TOOLS)
    object.__setattr__(body, "tool_choice", "required")       # the field may not be declared on this model
    with pytest.raises(APIError) as info:
        asyncio.run(body_structured_spec(FakeEngine(), body))
    assert info.value.param == "response_format"


VOCAB_SIZE = 1000


def test_sampling_params_carry_the_spec() -> None:
    spec = StructuredSpec("choice", choices=("a", "b"), source="guided_choice")
    sampling = sampling_params_for(chat(), 8, NO_DEFAULTS, VOCAB_SIZE, structured=spec)
    assert sampling.structured == spec
    assert sampling_params_for(chat(), 8, NO_DEFAULTS, VOCAB_SIZE).structured is None
