"""kvhive.structured: each constraint kind compiled for the default model's vocabulary accepts the
text it should and refuses what it should not; compiled grammars are cached per spec; bad or
oversized specs raise StructuredOutputError naming their source field."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvhive.core.structured_spec import StructuredSpec, ToolCallFormat
from kvhive.structured import GrammarCompiler, StructuredOutputError
from kvhive.structured.grammars import MAX_SPEC_CHARS

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
CALL = {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    "required": ["name", "arguments"]}
HERMES = ToolCallFormat(begin="<tool_call>\n", end="\n</tool_call>", separator="\n", min_calls=1, max_calls=2)
ONE_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids, cache_size=4)


def walk(compiler: GrammarCompiler, spec: StructuredSpec, text: str, eos: bool = False):
    """A fresh matcher fed ``text``'s tokens (then EOS with ``eos``); (all accepted, complete afterwards)."""
    matcher = compiler.compile(spec).matcher()
    tokens = compiler.tokenizer.encode(text) + ([compiler.tokenizer.eos_token_ids[0]] if eos else [])
    ok = all(matcher.accept(t) for t in tokens)
    return ok, ok and matcher.is_complete


CASES = [
    (StructuredSpec("json_object"), '{"a": [1, 2], "b": null}', '[1, 2]'),
    (StructuredSpec("json_schema", schema=json.dumps(SCHEMA)), '{"name": "Ada", "age": 36}', '{"name": "Ada"}'),
    (StructuredSpec("regex", pattern=r"[a-z]{3}-[0-9]{2}"), "abc-12", "abc-1x"),
    (StructuredSpec("choice", choices=("yes", "no", 'say "hi"\n')), 'say "hi"\n', "maybe"),
    (StructuredSpec("grammar", grammar='start: "a"+ "b"'), "aaab", "ba"),
    (StructuredSpec("grammar", grammar='root ::= "x" [0-9]+'), "x42", "y42"),
    (StructuredSpec("tool_calls", schema=json.dumps(CALL), tool_format=HERMES), ONE_CALL + "\n" + ONE_CALL,
     '{"name": "get_weather"}'),
    # Llama 3.x: a bare JSON object per call.
    (StructuredSpec("tool_calls", schema=json.dumps(CALL), tool_format=ToolCallFormat(begin="", end="", max_calls=1)),
     '{"name": "get_weather", "arguments": {"city": "Oslo"}}', '<tool_call>\n{"name": "get_weather"}'),
]


@pytest.mark.parametrize("spec,good,bad", CASES, ids=[c[0].kind + str(i) for i, c in enumerate(CASES)])
def test_each_kind_accepts_its_language(compiler, spec, good, bad) -> None:
    # A grammar that could go on ("a"+, a second tool call) is complete once EOS is taken.
    assert walk(compiler, spec, good) == (True, True) or walk(compiler, spec, good, eos=True) == (True, True)
    assert walk(compiler, spec, bad, eos=True) == (False, False)


def test_json_schema_output_is_complete_after_the_closing_brace(compiler) -> None:
    matcher = compiler.compile(StructuredSpec("json_schema", schema=json.dumps(SCHEMA))).matcher()
    for t in compiler.tokenizer.encode('{"name": "Ada", "age": 3'):
        assert matcher.accept(t)
    assert not matcher.is_complete
    assert all(matcher.accept(t) for t in compiler.tokenizer.encode("6}"))
    assert matcher.is_complete


def test_end_of_sequence_completes_an_open_ended_grammar(compiler) -> None:
    matcher = compiler.compile(StructuredSpec("regex", pattern="[0-9]+")).matcher()
    assert all(matcher.accept(t) for t in compiler.tokenizer.encode("123"))
    assert not matcher.is_complete
    assert matcher.accept(compiler.tokenizer.eos_token_ids[0])
    assert matcher.is_complete


def test_tool_calls_respect_max_calls(compiler) -> None:
    spec = StructuredSpec("tool_calls", schema=json.dumps(CALL), tool_format=HERMES)
    assert walk(compiler, spec, "\n".join([ONE_CALL] * 2)) == (True, True)
    assert walk(compiler, spec, "\n".join([ONE_CALL] * 3))[0] is False


def test_a_marker_that_is_a_special_token_matches_that_token(compiler) -> None:
    tok = compiler.tokenizer
    fmt = ToolCallFormat(begin="<|im_start|>", end="", max_calls=1)
    matcher = compiler.compile(StructuredSpec("tool_calls", schema='{"type": "array"}', tool_format=fmt)).matcher()
    start_id = tok.encode("<|im_start|>")[0]
    assert matcher.accept(start_id)
    assert all(matcher.accept(t) for t in tok.encode("[]"))
    assert matcher.is_complete


def test_the_mask_allows_exactly_the_grammar_s_next_tokens(compiler) -> None:
    tok = compiler.tokenizer
    matcher = compiler.compile(StructuredSpec("choice", choices=("alpha", "beta"))).matcher()
    bitmask = np.zeros((1, compiler.mask_words), dtype=np.int32)
    matcher.fill_mask(bitmask[0])
    allowed = np.nonzero(np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[0])[0]
    texts = {tok.token_bytes(int(i)) for i in allowed}
    assert texts and all(b"alpha".startswith(t) or b"beta".startswith(t) for t in texts)
    assert tok.encode("alpha")[0] in allowed


def test_compiled_once_per_distinct_spec(tokenizer) -> None:
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids, cache_size=2)
    a, b, c = (StructuredSpec("regex", pattern=p) for p in ("a+", "b+", "c+"))
    first = compiler.compile(a)
    assert compiler.compile(StructuredSpec("regex", pattern="a+")) is first
    assert (compiler.hits, compiler.misses) == (1, 1)
    compiler.compile(b)
    compiler.compile(c)                 # evicts a, the least recently used
    assert compiler.compile(a) is not first
    assert compiler.misses == 4


BAD = [
    (StructuredSpec("json_schema", schema="{not json"), "not valid"),
    (StructuredSpec("json_schema", schema='{"type": "foo"}'), "foo"),
    (StructuredSpec("json_schema", schema=json.dumps({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                                      "$ref": "#/$defs/a"})), "admits no output"),
    (StructuredSpec("json_schema", schema='{"type": "object"' + ', "properties": {"a": {"type": "object"' * 3000
                    + "}}" * 3000 + "}"), "recursion"),
    (StructuredSpec("json_schema", schema=json.dumps({"type": "string", "format": "no-such-format"})), "format"),
    (StructuredSpec("regex", pattern="(a"), "regex"),
    (StructuredSpec("grammar", grammar="start: undefined_rule"), "undefined_rule"),
    (StructuredSpec("json_schema", schema=" " * (MAX_SPEC_CHARS + 1), source="guided_json"), "characters"),
    (StructuredSpec("tool_calls", schema='{"type": "object"}',
                    tool_format=ToolCallFormat(begin="<a>", end="</a>", min_calls=3, max_calls=2)), "min_calls"),
]


@pytest.mark.parametrize("spec,words", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_specs_raise_structured_output_error(compiler, spec, words) -> None:
    with pytest.raises(StructuredOutputError) as info:
        compiler.compile(spec)
    assert words in str(info.value)
    assert info.value.param == spec.source
    with pytest.raises(StructuredOutputError):      # the failure is cached too
        compiler.compile(spec)


def test_a_pathological_regex_is_bounded(compiler) -> None:
    # Lexer fuel bounds the work: it either compiles (and masks are bounded per step) or fails.
    spec = StructuredSpec("regex", pattern="(a|aa)*(.*a){40}.{300}[a-z]{1000}")
    try:
        matcher = compiler.compile(spec).matcher()
    except StructuredOutputError as exc:
        assert "regex" in str(exc) or "limit" in str(exc).lower() or "fuel" in str(exc).lower()
        return
    bitmask = np.zeros((1, compiler.mask_words), dtype=np.int32)
    matcher.fill_mask(bitmask[0])
    assert bitmask.any() or matcher.error is not None


def test_the_mask_fallback_is_forced_from_the_environment() -> None:
    from kvhive.cli import grammar_mask_from_env
    from kvhive.config import EngineConfig

    config = EngineConfig(model_path="m")
    assert grammar_mask_from_env(config, {}).grammar_mask_overlap is True
    assert grammar_mask_from_env(config, {"KVHIVE_GRAMMAR_MASK_SYNC": "1"}).grammar_mask_overlap is False
    with pytest.raises(ValueError, match="KVHIVE_GRAMMAR_MASK_SYNC"):
        grammar_mask_from_env(config, {"KVHIVE_GRAMMAR_MASK_SYNC": "yes"})


def test_a_compile_over_the_time_limit_is_refused(tokenizer) -> None:
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids, time_limit_s=0.0)
    with pytest.raises(StructuredOutputError, match="limit"):
        compiler.compile(StructuredSpec("regex", pattern="[0-9]+"))
