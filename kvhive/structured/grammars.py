"""A ``StructuredSpec`` as the grammar text llguidance reads.

- ``json_object`` / ``json_schema``: llguidance's JSON-schema compiler, output in one line with
  ``", "`` and ``": "`` between items (no free whitespace: a model cannot pad an answer with
  spaces until ``max_tokens``); keywords it does not implement are refused, never ignored.
- ``regex``: the pattern, matched in full (Rust ``regex`` syntax, as llguidance reads it).
- ``choice``: exactly one of the strings.
- ``grammar``: a Lark grammar in llguidance's dialect, or a GBNF (llama.cpp / xgrammar EBNF,
  ``root ::= ...``) grammar, which llguidance converts to Lark.
- ``tool_calls``: ``begin`` + JSON matching the schema + ``end``, ``separator`` between calls,
  between ``min_calls`` and ``max_calls`` calls, written as a Lark grammar with ``%json``.

Every spec's text is bounded (``MAX_SPEC_CHARS``) before any of it reaches the library.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from kvhive.core.structured_spec import StructuredSpec
from kvhive.structured.errors import StructuredOutputError

# The most characters of text a spec may carry (schema, pattern, grammar, choices, tool-call
# markers together): a schema of 20 tool definitions is about 10-40k.
MAX_SPEC_CHARS = 256 * 1024
# JSON output as one line, items separated as json.dumps separates them.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": False}


def spec_chars(spec: StructuredSpec) -> int:
    """How many characters of text ``spec`` carries."""
    fmt = spec.tool_format
    markers = 0 if fmt is None else len(fmt.begin) + len(fmt.end) + len(fmt.separator)
    return (len(spec.schema or "") + len(spec.pattern or "") + len(spec.grammar or "")
            + sum(len(c) for c in spec.choices) + markers)


def grammar_text(spec: StructuredSpec, special_ids: Mapping[str, int]) -> str:
    """The llguidance grammar of ``spec`` (StructuredOutputError when its text is too large or not
    well-formed). ``special_ids``: the vocabulary's special tokens by text, so a tool-call marker
    that is one (Mistral's ``[TOOL_CALLS]``) matches that token."""
    import llguidance

    size = spec_chars(spec)
    if size > MAX_SPEC_CHARS:
        raise StructuredOutputError(f"the {spec.kind} constraint is {size} characters; at most "
                                    f"{MAX_SPEC_CHARS} are accepted", spec.source)
    try:
        if spec.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=JSON_OPTIONS)
        if spec.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.schema, overrides=JSON_OPTIONS)
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.pattern)
        if spec.kind == "choice":
            return "start: " + " | ".join(_literal(c, special_ids) or '""' for c in spec.choices) + "\n"
        if spec.kind == "grammar":
            return llguidance.grammar_from("grammar", spec.grammar)
        if spec.kind == "tool_calls":
            return _tool_calls(spec, special_ids)
    except (ValueError, TypeError) as exc:
        raise StructuredOutputError(f"the {spec.kind} constraint is not valid: {exc}", spec.source) from exc
    raise StructuredOutputError(f"unknown constraint kind {spec.kind!r}", spec.source)


def _tool_calls(spec: StructuredSpec, special_ids: Mapping[str, int]) -> str:
    """Lark: ``start`` is min_calls..max_calls calls, each begin + %json{schema} + end."""
    fmt = spec.tool_format
    if fmt.min_calls < 0 or (fmt.max_calls is not None and fmt.max_calls < max(fmt.min_calls, 1)):
        raise StructuredOutputError(f"tool calls need 0 <= min_calls <= max_calls and max_calls >= 1, got "
                                    f"{fmt.min_calls}..{fmt.max_calls}", spec.source)
    schema = json.loads(spec.schema)
    if not isinstance(schema, dict):
        raise StructuredOutputError("a tool call's schema must be a JSON object", spec.source)
    schema = {**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}}
    call = " ".join(p for p in (_literal(fmt.begin, special_ids),
                                "%json " + json.dumps(schema, ensure_ascii=False),
                                _literal(fmt.end, special_ids)) if p)
    sep = _literal(fmt.separator, special_ids)
    more_min = max(fmt.min_calls - 1, 0)
    more = f"({sep} call)" if sep else "call"
    if fmt.max_calls is None:
        rest = f" {more}*" if more_min == 0 else f" {more}{{{more_min},}}"
    else:
        rest = "" if fmt.max_calls == 1 else f" {more}{{{more_min},{fmt.max_calls - 1}}}"
    calls = f"call{rest}"
    start = f"({calls})?" if fmt.min_calls == 0 else calls
    return f"start: {start}\ncall: {call}\n"


def _literal(text: str, special_ids: Mapping[str, int]) -> str:
    """``text`` as a Lark literal ("" for empty text); a special token's text as that token."""
    if not text:
        return ""
    if text in special_ids:
        return f"<[{special_ids[text]}]>"
    return json.dumps(text, ensure_ascii=False)
