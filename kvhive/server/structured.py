"""A request's structured-output fields as one ``StructuredSpec``, bounded, with a 400 naming the field.

Chat completions and completions take OpenAI's ``response_format`` (``text``, ``json_object``,
``json_schema``), vLLM's ``structured_outputs`` object and vLLM's older ``guided_json``,
``guided_regex``, ``guided_choice`` and ``guided_grammar``; the Responses API takes ``text.format``.
At most one constraint per request. A schema becomes its canonical JSON text (sorted keys, no
spaces), so equal schemas share one compiled grammar. Every text is bounded here, before the
grammar backend sees it; the backend bounds the compile itself (``EngineClient.check_structured``,
whose refusal is a 400 naming the field too).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from kvhive.core.json_body import BodyError, load_json
from kvhive.core.structured_spec import StructuredSpec
from kvhive.engine.client import EngineClient, StructuredOutputError
from kvhive.server.errors import APIError, bad_request
from kvhive.server.protocol import StructuredOutputFields

# Bounds of what a request may ask, checked before anything is compiled.
MAX_SCHEMA_CHARS = 256 * 1024          # a schema's canonical JSON text (OpenAI allows 120k of names alone)
MAX_SCHEMA_DEPTH = 48                  # nested arrays and objects in a schema (10 object levels need ~25)
MAX_PATTERN_CHARS = 16 * 1024          # a regular expression
MAX_GRAMMAR_CHARS = 64 * 1024          # a Lark/EBNF grammar
MAX_CHOICE_OPTIONS = 1024              # strings of a choice
MAX_CHOICE_CHARS = 64 * 1024           # all of a choice's strings together
MAX_FORMAT_DESCRIPTION_CHARS = 16 * 1024
FORMAT_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")        # OpenAI's rule for a json_schema's name
# Grammar backends ``guided_decoding_backend`` may name: "auto", or the one kvhive runs (llguidance,
# which vLLM calls "guidance").
GRAMMAR_BACKENDS = ("auto", "guidance", "llguidance")


@dataclass(frozen=True)
class RequestedOutput:
    """The constraint a request asks for, and the field that holds its text (what an error names)."""

    spec: StructuredSpec
    param: str


# ---------------------------------------------------------------- texts and their bounds


def _missing(param: str) -> APIError:
    return bad_request(f"Missing required parameter: '{param}'", param=param)


def _check_keys(obj: Mapping[str, Any], allowed: Sequence[str], param: str) -> None:
    """400 naming the first key of ``obj`` not in ``allowed``."""
    for key in obj:
        if key not in allowed:
            shown = key if len(key) <= 64 else key[:64] + "..."
            raise bad_request(f"Unrecognized parameter '{param}.{shown}'; '{param}' takes "
                              f"{', '.join(repr(a) for a in allowed)}", param=f"{param}.{shown}")


def _object(value: Any, param: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise bad_request(f"'{param}' must be an object, got {type(value).__name__}", param=param)
    return value


def _text(value: Any, param: str, limit: int) -> str:
    """``value`` as a non-empty string of at most ``limit`` characters."""
    if not isinstance(value, str):
        raise bad_request(f"'{param}' must be a string, got {type(value).__name__}", param=param)
    if not value:
        raise bad_request(f"'{param}' must not be empty", param=param)
    if len(value) > limit:
        raise bad_request(f"'{param}' is {len(value)} characters; at most {limit} are allowed", param=param)
    return value


def _flag(value: Any, param: str) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise bad_request(f"'{param}' must be a boolean, got {type(value).__name__}", param=param)
    return value


def schema_depth_exceeds(schema: Any, limit: int = MAX_SCHEMA_DEPTH) -> bool:
    """True when ``schema`` nests arrays and objects deeper than ``limit`` (iterative: no recursion)."""
    stack = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def canonical_schema(value: Any, param: str) -> str:
    """A JSON schema (an object, or for vLLM's fields also its JSON text) as its canonical JSON
    text: sorted keys, no spaces; 400 naming ``param`` beyond the bounds."""
    if isinstance(value, str):
        if len(value) > MAX_SCHEMA_CHARS:
            raise bad_request(f"'{param}' is {len(value)} characters; a schema may have at most "
                              f"{MAX_SCHEMA_CHARS}", param=param)
        try:
            value = load_json(value.encode("utf-8", "surrogatepass"))
        except BodyError as exc:
            raise bad_request(f"'{param}' is not a JSON schema: {exc.message}", param=param) from None
    if not isinstance(value, dict):
        raise bad_request(f"'{param}' must be a JSON schema object, got {type(value).__name__}", param=param)
    if schema_depth_exceeds(value):
        raise bad_request(f"'{param}' nests arrays and objects deeper than {MAX_SCHEMA_DEPTH} levels",
                          param=param)
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    if len(text) > MAX_SCHEMA_CHARS:
        raise bad_request(f"'{param}' is {len(text)} characters as compact JSON; a schema may have at most "
                          f"{MAX_SCHEMA_CHARS}", param=param)
    return text


def choices_of(value: Any, param: str) -> tuple[str, ...]:
    """A choice's strings: 1 to MAX_CHOICE_OPTIONS non-empty strings, MAX_CHOICE_CHARS in all."""
    if not isinstance(value, list) or not value:
        raise bad_request(f"'{param}' must be a non-empty list of strings", param=param)
    if len(value) > MAX_CHOICE_OPTIONS:
        raise bad_request(f"'{param}' has {len(value)} strings; at most {MAX_CHOICE_OPTIONS} are allowed",
                          param=param)
    for i, choice in enumerate(value):
        _text(choice, f"{param}[{i}]", MAX_CHOICE_CHARS)
    total = sum(len(c) for c in value)
    if total > MAX_CHOICE_CHARS:
        raise bad_request(f"'{param}' holds {total} characters; at most {MAX_CHOICE_CHARS} in all", param=param)
    return tuple(value)


# ---------------------------------------------------------------- OpenAI's formats


def _json_schema(fmt: Mapping[str, Any], param: str, source: str) -> RequestedOutput:
    """A json_schema format's ``name``, ``schema``, ``strict`` and ``description`` (``fmt``'s own
    keys at ``param``); the schema constrains the output whatever ``strict`` says."""
    if "name" not in fmt:
        raise _missing(f"{param}.name")
    name = _text(fmt["name"], f"{param}.name", 64)
    if not FORMAT_NAME.fullmatch(name):
        raise bad_request(f"'{param}.name' may hold only a-z, A-Z, 0-9, '_' and '-' (at most 64)",
                          param=f"{param}.name")
    _flag(fmt.get("strict"), f"{param}.strict")
    if fmt.get("description") is not None:
        _text(fmt["description"], f"{param}.description", MAX_FORMAT_DESCRIPTION_CHARS)
    if fmt.get("schema") is None:
        raise _missing(f"{param}.schema")
    _object(fmt["schema"], f"{param}.schema")           # OpenAI's formats take no schema text
    schema = canonical_schema(fmt["schema"], f"{param}.schema")
    return RequestedOutput(StructuredSpec("json_schema", schema=schema, source=source), f"{param}.schema")


_JSON_SCHEMA_KEYS = ("name", "schema", "strict", "description")


def _format_output(value: Any, param: str, nested: bool) -> RequestedOutput | None:
    """OpenAI's format object at ``param``: ``text`` (None), ``json_object`` or ``json_schema``,
    whose fields sit in a ``json_schema`` object when ``nested`` (chat), beside ``type`` when not
    (the Responses API)."""
    fmt = _object(value, param)
    kind = fmt.get("type")
    if kind == "text" or kind == "json_object":
        _check_keys(fmt, ("type",), param)
        return None if kind == "text" else RequestedOutput(StructuredSpec("json_object", source=param), param)
    if kind == "json_schema" and not nested:
        _check_keys(fmt, ("type", *_JSON_SCHEMA_KEYS), param)
        return _json_schema(fmt, param, param)
    if kind == "json_schema":
        _check_keys(fmt, ("type", "json_schema"), param)
        if fmt.get("json_schema") is None:
            raise _missing(f"{param}.json_schema")
        inner = _object(fmt["json_schema"], f"{param}.json_schema")
        _check_keys(inner, _JSON_SCHEMA_KEYS, f"{param}.json_schema")
        return _json_schema(inner, f"{param}.json_schema", param)
    if kind is None:
        raise _missing(f"{param}.type")
    raise bad_request(f"'{param}.type' must be 'text', 'json_object' or 'json_schema', got {str(kind)[:64]!r}",
                      param=f"{param}.type")


def response_format_output(value: Any, param: str = "response_format") -> RequestedOutput | None:
    """Chat's (and completions') ``response_format``: ``{"type": "text"}`` (None),
    ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {name, schema, strict,
    description}}``."""
    return None if value is None else _format_output(value, param, nested=True)


def text_format_output(text: Any, param: str = "text") -> RequestedOutput | None:
    """The Responses API's ``text.format``: ``{"type": "text"}`` (None), ``{"type": "json_object"}``
    or ``{"type": "json_schema", name, schema, strict, description}`` (flat). ``text``'s other
    keys are the caller's to check."""
    fmt = None if text is None else _object(text, param).get("format")
    return None if fmt is None else _format_output(fmt, f"{param}.format", nested=False)


# ---------------------------------------------------------------- vLLM's fields

# ``structured_outputs`` keys that each ask for one constraint; its options, accepted absent, null or
# at the value kvhive's backend has anyway (any other value would change the output: a 400); and
# ``disable_fallback``, any boolean (there is one backend, which never falls back).
_CONSTRAINT_KEYS = ("json", "regex", "choice", "grammar", "json_object")
_OPTION_VALUES: dict[str, tuple[bool, ...]] = {
    "disable_any_whitespace": (False,),
    "disable_additional_properties": (False,),
    "whitespace_pattern": (),
    "structural_tag": (),
}
_OPTION_KEYS = ("disable_fallback", *_OPTION_VALUES)


def _check_options(obj: Mapping[str, Any], param: str) -> None:
    _flag(obj.get("disable_fallback"), f"{param}.disable_fallback")
    for key, accepted in _OPTION_VALUES.items():
        value = obj.get(key)
        if value is not None and not any(value is a for a in accepted):
            raise bad_request(f"'{param}.{key}' is not supported; leave it out", param=f"{param}.{key}")


def _constraint(kind: str, value: Any, param: str, source: str) -> RequestedOutput:
    """One of vLLM's constraints: ``json`` (a schema, object or text), ``regex``, ``choice``,
    ``grammar``, ``json_object`` (true)."""
    if kind == "json":
        return RequestedOutput(StructuredSpec("json_schema", schema=canonical_schema(value, param), source=source),
                               param)
    if kind == "regex":
        return RequestedOutput(StructuredSpec("regex", pattern=_text(value, param, MAX_PATTERN_CHARS),
                                              source=source), param)
    if kind == "choice":
        return RequestedOutput(StructuredSpec("choice", choices=choices_of(value, param), source=source), param)
    if kind == "grammar":
        return RequestedOutput(StructuredSpec("grammar", grammar=_text(value, param, MAX_GRAMMAR_CHARS),
                                              source=source), param)
    assert kind == "json_object"
    if value is not True:
        raise bad_request(f"'{param}' must be true (leave it out for no constraint)", param=param)
    return RequestedOutput(StructuredSpec("json_object", source=source), param)


def structured_outputs_output(value: Any, param: str = "structured_outputs") -> RequestedOutput | None:
    """vLLM's ``structured_outputs``: exactly one of ``json``, ``regex``, ``choice``, ``grammar``,
    ``json_object``; its options only at the values kvhive's backend has anyway."""
    if value is None:
        return None
    obj = _object(value, param)
    _check_keys(obj, _CONSTRAINT_KEYS + _OPTION_KEYS, param)
    _check_options(obj, param)
    asked = [key for key in _CONSTRAINT_KEYS if obj.get(key) is not None]
    if not asked:
        raise bad_request(f"'{param}' must set one of {', '.join(_CONSTRAINT_KEYS)}", param=param)
    if len(asked) > 1:
        raise bad_request(f"'{param}' sets {' and '.join(asked)}; set only one constraint",
                          param=f"{param}.{asked[1]}")
    return _constraint(asked[0], obj[asked[0]], f"{param}.{asked[0]}", param)


_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


def guided_outputs(body: Any) -> list[RequestedOutput]:
    """vLLM's older ``guided_*`` fields that the body sets; ``guided_decoding_backend`` only
    "auto" or kvhive's backend, ``guided_whitespace_pattern`` refused (it changes the output)."""
    backend = getattr(body, "guided_decoding_backend", None)
    if backend is not None and backend not in GRAMMAR_BACKENDS:
        raise bad_request(f"'guided_decoding_backend' must be one of {', '.join(GRAMMAR_BACKENDS)} (kvhive runs "
                          f"llguidance), got {backend[:64]!r}", param="guided_decoding_backend")
    if getattr(body, "guided_whitespace_pattern", None) is not None:
        raise bad_request("'guided_whitespace_pattern' is not supported; leave it out",
                          param="guided_whitespace_pattern")
    return [_constraint(kind, getattr(body, field), field, field)
            for field, kind in _GUIDED_FIELDS.items() if getattr(body, field, None) is not None]


# ---------------------------------------------------------------- a request's one constraint


def one_output(outputs: Sequence[RequestedOutput | None]) -> RequestedOutput | None:
    """The one constraint among ``outputs`` (None when there is none); 400 naming the second."""
    asked = [o for o in outputs if o is not None]
    if len(asked) > 1:
        first, second = asked[0].spec.source, asked[1].spec.source
        raise bad_request(f"'{first}' and '{second}' both constrain the output; send only one",
                          param=second)
    return asked[0] if asked else None


def requested_output(body: Any) -> RequestedOutput | None:
    """A chat or completion body's constraint: ``response_format``, ``structured_outputs``, a
    ``guided_*`` field, or None; 400 naming the field that is malformed, out of bounds or a second
    constraint."""
    return one_output([response_format_output(getattr(body, "response_format", None)),
                       structured_outputs_output(getattr(body, "structured_outputs", None)),
                       *guided_outputs(body)])


def forces_tool_call(tools: Any, tool_choice: Any) -> bool:
    """Whether ``tool_choice`` makes the output a tool call: "required", a named function (chat's
    ``{"type": "function", "function": {"name"}}``, the Responses API's ``{"type": "function",
    "name"}``) or OpenAI's ``{"type": "allowed_tools", "mode": "required"}``; a dict or a model with
    those attributes."""
    if not tools:
        return False
    if tool_choice == "required":
        return True

    def field(name: str) -> Any:
        return tool_choice.get(name) if isinstance(tool_choice, dict) else getattr(tool_choice, name, None)

    kind = field("type")
    return kind == "function" or (kind == "allowed_tools" and field("mode") == "required")


def check_format_with_tools(requested: RequestedOutput | None, tools: Any, tool_choice: Any) -> None:
    """400 naming the format's field when a tool call is forced and a format constrains the output
    too: the output cannot be both."""
    if requested is not None and forces_tool_call(tools, tool_choice):
        raise bad_request(f"'{requested.spec.source}' cannot constrain the output while 'tool_choice' forces a "
                          f"tool call; use one or the other", param=requested.spec.source)


# ---------------------------------------------------------------- the compile check


def sets_output_fields(body: StructuredOutputFields) -> bool:
    """Whether a chat or completion body sets any field that may constrain its output."""
    return any(getattr(body, name) is not None for name in StructuredOutputFields.model_fields)


async def checked_spec(engine: EngineClient, requested: RequestedOutput | None) -> StructuredSpec | None:
    """``requested``'s spec once the grammar backend compiled it (cached there, bounded in time and
    size); 400 naming the field when it cannot."""
    if requested is None:
        return None
    try:
        await engine.check_structured(requested.spec)
    except StructuredOutputError as exc:
        raise bad_request(f"Invalid '{requested.param}': {exc.message}",
                          param=requested.param) from None
    return requested.spec


async def structured_spec(engine: EngineClient, read: Callable[[], RequestedOutput | None],
                          tools: Any = None, tool_choice: Any = None) -> StructuredSpec | None:
    """The spec a request's output decodes under: ``read`` (one of the readers above, bound to the
    body) on a worker thread (a schema is walked and serialized), the tools check, then the compile
    check; None without a constraint."""
    requested = await asyncio.to_thread(read)
    check_format_with_tools(requested, tools, tool_choice)
    return await checked_spec(engine, requested)


async def body_structured_spec(engine: EngineClient, body: StructuredOutputFields) -> StructuredSpec | None:
    """A chat or completion body's spec (``structured_spec`` over ``requested_output``); its
    ``tools`` and ``tool_choice`` read with getattr: a body without them forces no tool call."""
    if not sets_output_fields(body):
        return None
    return await structured_spec(engine, partial(requested_output, body), getattr(body, "tools", None),
                                 getattr(body, "tool_choice", None))


async def text_structured_spec(engine: EngineClient, text: Mapping[str, Any] | None, tools: Any,
                               tool_choice: Any) -> StructuredSpec | None:
    """A Responses request's spec (``structured_spec`` over ``text_format_output``)."""
    if text is None or text.get("format") is None:
        return None
    return await structured_spec(engine, partial(text_format_output, text), tools, tool_choice)


def text_format(text: Mapping[str, Any] | None) -> Any:
    """The ``text.format`` a response object echoes: the request's (checked), or text."""
    return (text or {}).get("format") or {"type": "text"}
