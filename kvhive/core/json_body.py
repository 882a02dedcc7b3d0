"""Reading a request's JSON body without trusting it (torch-free; the server and the gateway share it).

A body is UTF-8 JSON nested at most MAX_JSON_DEPTH levels (checked before parsing: Python's parser
and pydantic recurse per level), without NaN or Infinity (not JSON, nor a number too large for a
float), whose strings are valid Unicode: no lone surrogate (``"\\ud800"``), which the tokenizer and
the UTF-8 response headers cannot carry.

Every check here takes time linear in the body's size, whatever its bytes (a string that never
closes, runs of escapes, megabytes of brackets or digits): one pass of C loops (bytes methods,
numpy, the json module), no regular expression that can backtrack. The work of a body of
OFF_LOOP_BODY_BYTES or more belongs on a worker thread, not on an event loop.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
from pydantic import BaseModel, ValidationError

BodyT = TypeVar("BodyT", bound=BaseModel)
T = TypeVar("T")

# Deepest nesting of arrays and objects a body may have (OpenAI bodies need under 10; a tool's
# JSON schema a few more).
MAX_JSON_DEPTH = 64
# Bodies of this many bytes or more are checked and parsed on a worker thread (json.loads and
# pydantic take ~10 ms per MiB, a hostile body up to ~50).
OFF_LOOP_BODY_BYTES = 1 << 16

# Location parts pydantic adds for union members and model classes ("str", "list[int]", "ContentPart");
# they are not field names and stay out of ``param``.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})
_IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]*$")
# An escape that decodes to a surrogate code point (a lone one, or half of a pair).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
# The longest key a ``param`` path shows whole.
_PARAM_KEY_CHARS = 64

# The nesting scan keeps quotes and brackets only, objects' braces read as arrays' brackets.
_AS_BRACKETS = bytes.maketrans(b"{}", b"[]")
_NOT_MARKS = bytes(sorted(set(range(256)) - set(b'"[]{}')))
_QUOTE = b'"'[0]
# A mark's step in depth: +1 for "[", -1 for "]", 0 for a quote.
_STEP = np.zeros(256, dtype=np.int8)
_STEP[b"["[0]], _STEP[b"]"[0]] = 1, -1
# The scan works through this many marks at a time (bounded memory, and each numpy call short).
_SCAN_WINDOW = 1 << 18


class BodyError(ValueError):
    """A body that is not acceptable JSON; ``param`` names the offending field when one does."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class MalformedJSON(BodyError):
    """A body that is not UTF-8 JSON at all (a proxy may pass it on as it is)."""


def nesting_exceeds(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when the JSON text ``raw`` nests arrays and objects deeper than ``limit``.

    Brackets inside strings are text. A string runs from a quote to the next quote that is not
    escaped (one after an odd run of backslashes is), or to the end of ``raw`` when none closes it.
    Closing brackets count down even below zero (malformed JSON, which the parser refuses anyway).
    Linear in ``len(raw)``."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False                    # the common case: too few brackets to nest that deep
    if b"\\" in raw:
        # A run of backslashes loses its pairs (each an escaped backslash); one left before a quote
        # escapes it, and both go. Every quote left opens or closes a string.
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    marks = raw.translate(_AS_BRACKETS, _NOT_MARKS)
    if marks.count(b"[") <= limit:
        return False
    return _marks_deeper_than(np.frombuffer(marks, dtype=np.uint8), limit)


def _marks_deeper_than(marks: np.ndarray, limit: int) -> bool:
    """Whether ``marks`` (quotes and square brackets only, no escapes) nest deeper than ``limit``
    outside strings; a window at a time, carrying the depth and whether a string is open."""
    depth, in_string = 0, 0
    for start in range(0, len(marks), _SCAN_WINDOW):
        window = marks[start:start + _SCAN_WINDOW]
        steps = _STEP[window]
        if in_string or (window == _QUOTE).any():
            # Odd after an odd number of quotes (the one opening a string included): in a string.
            inside = np.cumsum(window == _QUOTE, dtype=np.uint8)
            inside += in_string
            inside &= 1
            steps = np.where(inside.view(bool), np.int8(0), steps)
            in_string = int(inside[-1])
        depths = np.cumsum(steps, dtype=np.int32)
        if int(depths.max()) + depth > limit:
            return True
        depth += int(depths[-1])
    return False


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


def _finite_float(text: str) -> float:
    value = float(text)                 # linear: CPython rounds from the first digits it needs
    if math.isinf(value):
        raise ValueError(f"the number {text[:32]}{'...' if len(text) > 32 else ''} is out of range")
    return value


def load_json(raw: bytes) -> Any:
    """The parsed body; MalformedJSON when it is not UTF-8 JSON (or holds NaN, Infinity or a number
    out of a float's range), BodyError when it nests deeper than MAX_JSON_DEPTH or a string holds a
    lone surrogate (its field is ``param``). Linear in ``len(raw)``."""
    if nesting_exceeds(raw):
        raise BodyError(f"The request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels")
    try:
        # Strict UTF-8 (json.loads of bytes would let encoded surrogates through).
        data = json.loads(raw.decode("utf-8"), parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise BodyError(f"The request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:           # JSONDecodeError, UnicodeDecodeError, NaN, integers over 4,300 digits
        raise MalformedJSON(f"Malformed JSON in request body: {exc}") from None
    if _SURROGATE_ESCAPE.search(raw):
        param = lone_surrogate_param(data)
        if param is not None:
            where = f"'{param}'" if param else "the request body"
            raise BodyError(f"Invalid Unicode in {where}: a lone surrogate (\\ud800-\\udfff) is not a "
                            f"character; send text as valid UTF-8", param=param or None)
    return data


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


def validation_body_error(errors: Sequence[Any]) -> BodyError:
    """The BodyError for pydantic / FastAPI validation errors, naming the first offending field."""
    if not errors:
        return BodyError("Invalid request body")
    first = errors[0]
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
