"""Reading a request's JSON body without trusting it (torch-free; the server and the gateway share it).

A body is UTF-8 JSON nested at most MAX_JSON_DEPTH levels (checked before parsing: Python's parser
and pydantic recurse per level), without NaN or Infinity (not JSON, nor a number too large for a
float), whose strings are valid Unicode: no lone surrogate (``"\\ud800"``), which the tokenizer and
the UTF-8 response headers cannot carry.

Every check here takes time linear in the body's size, whatever its bytes (a string that never
closes, runs of escapes, megabytes of brackets or digits): passes of C loops (bytes methods,
``kvhive.core.json_shape``'s numpy scan, the json module), no regular expression that can
backtrack. The scan also bounds what the parser builds: at most MAX_JSON_CONTAINERS arrays and
objects and MAX_JSON_ITEMS items. The work of a body of OFF_LOOP_BODY_BYTES or more belongs on a
worker thread, not on an event loop.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Callable, Sequence
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, Field, ValidationError

from kvhive.core import json_shape
from kvhive.core.request_fields import UNRECOGNIZED_FIELD

BodyT = TypeVar("BodyT", bound=BaseModel)
T = TypeVar("T")

# Deepest nesting of arrays and objects a body may have (OpenAI bodies need under 10; a tool's
# JSON schema a few more).
MAX_JSON_DEPTH = 64
# Most arrays and objects, and most items (arrays, objects, and the values and keys their commas
# and colons separate), a body may hold: a parser spends ~1 us on each array or object, ~0.3 us on
# each other value, all of it holding the GIL; OpenAI bodies hold far fewer.
MAX_JSON_CONTAINERS = 1 << 16
MAX_JSON_ITEMS = 1 << 20
# Most digits an integer may have (a seed needs 20): Python converts a long one in time quadratic
# in its digits, up to its own limit of 4,300.
MAX_INT_DIGITS = 100
# Bodies of this many bytes or more are checked and parsed on a worker thread (json.loads and
# pydantic take ~10 ms per MiB, a hostile body up to ~50).
OFF_LOOP_BODY_BYTES = 1 << 16

# A list field of a request model that stops at its first bad item: a million bad items are one
# error, not a million error records (and not one per member of a union of lists).
ListOf = Annotated[list[T], Field(fail_fast=True)]

# Location parts pydantic adds for union members and model classes ("str", "list[int]", "ContentPart");
# they are not field names and stay out of ``param``.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})
_IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]*$")
# An escape that decodes to a surrogate code point (a lone one, or half of a pair).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
# A run of digits longer than any integer may be (in a string or not: the parser tells), found
# as a run of nines once every digit reads as one (a search with no backtracking).
_DIGITS_AS_NINES = bytes.maketrans(b"0123456789", b"9" * 10)
_LONG_DIGITS = b"9" * (MAX_INT_DIGITS + 1)
# The longest key a ``param`` path shows whole.
_PARAM_KEY_CHARS = 64


class BodyError(ValueError):
    """A body that is not acceptable JSON; ``param`` names the offending field when one does."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class MalformedJSON(BodyError):
    """A body that is not UTF-8 JSON at all (a proxy may pass it on as it is)."""


def nesting_exceeds(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when the JSON text ``raw`` nests arrays and objects deeper than ``limit`` (brackets in
    strings are text); linear in ``len(raw)``."""
    return json_shape.nesting_exceeds(raw, limit)


def shape_refusal(raw: bytes) -> str | None:
    """Why the JSON text ``raw`` is refused before it is parsed (nested deeper than MAX_JSON_DEPTH,
    more than MAX_JSON_CONTAINERS arrays and objects or MAX_JSON_ITEMS items); None when it is not.
    Linear in ``len(raw)``, and two ``bytes.count`` calls for the common body."""
    opened = raw.count(b"[") + raw.count(b"{")
    if opened <= MAX_JSON_DEPTH and len(raw) + opened <= MAX_JSON_ITEMS:
        return None                     # too few brackets to nest that deep, too short for the rest
    shape = json_shape.json_shape(raw)
    if shape.depth > MAX_JSON_DEPTH:
        return f"The request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels"
    if shape.containers > MAX_JSON_CONTAINERS:
        return f"The request body holds {shape.containers} arrays and objects; at most {MAX_JSON_CONTAINERS}"
    if shape.containers + shape.separators > MAX_JSON_ITEMS:
        return (f"The request body holds {shape.containers + shape.separators} values and keys; "
                f"at most {MAX_JSON_ITEMS}")
    return None


def lone_surrogate_param(data: Any, path: str = "") -> str | None:
    """The path (``messages[0].content``) of the first string, or key, in parsed JSON ``data``
    that holds a lone surrogate, after ``path``; "" for the top level; None when every string is
    valid Unicode. Linear in the size of ``data`` (the path is written once, for the string found);
    a key over 64 characters shows its start, a lone surrogate as its escape."""
    found = _lone_surrogate_at(data)
    if found is None:
        return None
    for part in reversed(found):
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            key = _shown_key(part)
            path = f"{path}.{key}" if path else key
    return path


def _lone_surrogate_at(data: Any) -> list[str | int] | None:
    """Where the first string or key holding a lone surrogate is: keys and indexes, innermost
    first; None when there is none."""
    if isinstance(data, str):
        return [] if _has_lone_surrogate(data) else None
    if isinstance(data, list):
        for i, item in enumerate(data):
            found = _lone_surrogate_at(item)
            if found is not None:
                found.append(i)
                return found
    elif isinstance(data, dict):
        for key, value in data.items():
            if _has_lone_surrogate(key):
                return [key]
            found = _lone_surrogate_at(value)
            if found is not None:
                found.append(key)
                return found
    return None


def _shown_key(key: str) -> str:
    """A key as a ``param`` shows it: its lone surrogates escaped (an answer is UTF-8), a long key
    cut short."""
    if len(key) > _PARAM_KEY_CHARS:
        key = key[:_PARAM_KEY_CHARS - 3] + "..."
    return key.encode("utf-8", "backslashreplace").decode("utf-8")


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text.lstrip('-'))} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)                 # linear: CPython rounds from the first digits it needs
    if math.isinf(value):
        raise ValueError(f"the number {text[:32]}{'...' if len(text) > 32 else ''} is out of range")
    return value


def load_json(raw: bytes) -> Any:
    """The parsed body; MalformedJSON when it is not UTF-8 JSON (or holds NaN, Infinity, a number
    out of a float's range or an integer over MAX_INT_DIGITS digits), BodyError when its shape is refused (``shape_refusal``) or a string
    holds a lone surrogate (its field is ``param``). Linear in ``len(raw)``."""
    refusal = shape_refusal(raw)
    if refusal is not None:
        raise BodyError(refusal)
    try:
        # Strict UTF-8 (json.loads of bytes would let encoded surrogates through).
        long_digits = _LONG_DIGITS in raw.translate(_DIGITS_AS_NINES)
        parse_int = _bounded_int if long_digits else None       # else: the C parser's own
        data = json.loads(raw.decode("utf-8"), parse_constant=_no_constant, parse_float=_finite_float,
                          parse_int=parse_int)
    except RecursionError:
        raise BodyError(f"The request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:           # JSONDecodeError, UnicodeDecodeError, NaN, long integers
        raise MalformedJSON(f"Malformed JSON in request body: {exc}") from None
    if _SURROGATE_ESCAPE.search(raw):
        param = lone_surrogate_param(data)
        if param is not None:
            where = f"'{param}'" if param else "the request body"
            raise BodyError(f"Invalid Unicode in {where}: a lone surrogate (\\ud800-\\udfff) is not a "
                            f"character; send text as valid UTF-8", param=param or None)
    return data


def load_json_text(text: str) -> Any:
    """``load_json`` of JSON text a body field holds (a tool call's ``arguments``): the body's bounds
    on nesting and size apply to it too; BodyError (a ValueError) when it is refused."""
    return load_json(text.encode("utf-8", "surrogatepass"))


def param_from_loc(loc: Sequence[str | int]) -> str | None:
    """A pydantic error location as an OpenAI ``param``: ("body", "messages", 0, "role") -> messages[0].role."""
    param = ""
    for part in loc:
        if part == "body" and not param:
            continue
        if isinstance(part, int):
            param += f"[{part}]"
        elif part not in _TYPE_TAGS and _IDENTIFIER.match(part):
            param += f".{part}" if param else part
    return param or None


def unrecognized_param(loc: Sequence[str | int]) -> str:
    """The path of an undeclared field at pydantic location ``loc`` (its last part is the key, shown
    whatever its characters, a long one cut short): ("body", "messages", 0, "foo") -> messages[0].foo."""
    parent, key = param_from_loc(loc[:-1]), loc[-1]
    shown = f"[{key}]" if isinstance(key, int) else _shown_key(key)
    if parent is None or shown.startswith("["):
        return (parent or "") + shown
    return f"{parent}.{shown}"


def _telling_error(errors: Sequence[Any]) -> Any:
    """The first error, unless it is a type mismatch of one member of a union (``stop``: a string or
    a list) and another member of the same field fails on the value itself (the list is too long):
    then that one, which says what is wrong."""
    first = errors[0]
    if not str(first.get("type", "")).endswith("_type"):
        return first
    field = param_from_loc(first.get("loc", ()))
    if field is None:
        return first
    for error in errors[1:]:
        param = param_from_loc(error.get("loc", ())) or ""
        if (not str(error.get("type", "")).endswith("_type")
                and (param == field or param.startswith((f"{field}[", f"{field}.")))):
            return error
    return first


def validation_body_error(errors: Sequence[Any]) -> BodyError:
    """The BodyError for pydantic / FastAPI validation errors, naming the first offending field; an
    undeclared field is named first (``UNRECOGNIZED_FIELD``), even where a union's other members
    report a type error for its parent."""
    if not errors:
        return BodyError("Invalid request body")
    extra = next((e for e in errors if e.get("type") == "extra_forbidden" and e.get("loc")), None)
    if extra is not None:
        param = unrecognized_param(extra["loc"])
        return BodyError(UNRECOGNIZED_FIELD.format(param), param=param)
    first = _telling_error(errors)
    param = param_from_loc(first.get("loc", ()))
    if first.get("type") == "missing" and param is None:
        return BodyError("Request body is required (a JSON object)")
    if param is None:
        return BodyError(f"Invalid request body: {first.get('msg')}")
    if first.get("type") == "missing":
        return BodyError(f"Missing required parameter '{param}'", param=param)
    return BodyError(f"Invalid value for '{param}': {first.get('msg')}", param=param)


def json_object(raw: bytes) -> dict[str, Any]:
    """``raw`` as a JSON object; BodyError when it is empty, not acceptable JSON or not an object."""
    if not raw.strip():
        raise BodyError("Request body is required (a JSON object)")
    data: Any = load_json(raw)
    if not isinstance(data, dict):
        raise BodyError(f"Request body must be a JSON object, got {type(data).__name__}")
    return data


def parse_chosen_body(raw: bytes, choose: Callable[[dict[str, Any]], type[BodyT]]) -> BodyT:
    """``raw`` as the model ``choose`` picks from the parsed object (parsed once); BodyError naming
    the first bad field."""
    data = json_object(raw)
    try:
        return choose(data).model_validate(data)
    except ValidationError as exc:
        raise validation_body_error(exc.errors()) from None


async def off_loop_for(raw: bytes, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, work on the body ``raw``: on a worker thread when ``raw`` has
    OFF_LOOP_BODY_BYTES or more, so the event loop serves other requests meanwhile."""
    if len(raw) < OFF_LOOP_BODY_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)
