"""Reading a request's JSON body without trusting it (torch-free; the server and the gateway share it).

A body is UTF-8 JSON nested at most MAX_JSON_DEPTH levels (checked before parsing: Python's parser
and pydantic recurse per level), without NaN or Infinity (not JSON), whose strings are valid
Unicode: no lone surrogate (``"\\ud800"``), which the tokenizer and the UTF-8 response headers
cannot carry.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

BodyT = TypeVar("BodyT", bound=BaseModel)

# Deepest nesting of arrays and objects a body may have (OpenAI bodies need under 10; a tool's
# JSON schema a few more).
MAX_JSON_DEPTH = 64

# A JSON string (escapes included) or one bracket: strings are skipped when counting depth.
_STRING_OR_BRACKET = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)
_OPENING = frozenset(b"[{")
# Location parts pydantic adds for union members and model classes ("str", "list[int]", "ContentPart");
# they are not field names and stay out of ``param``.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})
_IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]*$")
# An escape that decodes to a surrogate code point (a lone one, or half of a pair).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


class BodyError(ValueError):
    """A body that is not acceptable JSON; ``param`` names the offending field when one does."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class MalformedJSON(BodyError):
    """A body that is not UTF-8 JSON at all (a proxy may pass it on as it is)."""


def nesting_exceeds(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when the JSON text ``raw`` nests arrays and objects deeper than ``limit``."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False                    # the common case: too few brackets to nest that deep
    depth = 0
    for match in _STRING_OR_BRACKET.finditer(raw):
        first = match.group()[0]
        if first == ord('"'):
            continue
        if first in _OPENING:
            depth += 1
            if depth > limit:
                return True
        else:
            depth -= 1
    return False


def lone_surrogate_param(data: Any, path: str = "") -> str | None:
    """The path (``messages[0].content``) of the first string, or key, in parsed JSON ``data``
    that holds a lone surrogate; "" for the top level; None when every string is valid Unicode."""
    if isinstance(data, str):
        return path if _has_lone_surrogate(data) else None
    if isinstance(data, list):
        for i, item in enumerate(data):
            found = lone_surrogate_param(item, f"{path}[{i}]")
            if found is not None:
                return found
    elif isinstance(data, dict):
        for key, value in data.items():
            inner = f"{path}.{key}" if path else key
            if _has_lone_surrogate(key):
                return inner
            found = lone_surrogate_param(value, inner)
            if found is not None:
                return found
    return None


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def load_json(raw: bytes) -> Any:
    """The parsed body; MalformedJSON when it is not UTF-8 JSON (or holds NaN or Infinity), BodyError
    when it nests deeper than MAX_JSON_DEPTH or a string holds a lone surrogate (its field is ``param``)."""
    if nesting_exceeds(raw):
        raise BodyError(f"The request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels")
    try:
        # Strict UTF-8 (json.loads of bytes would let encoded surrogates through).
        data = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except RecursionError:
        raise BodyError(f"The request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:           # JSONDecodeError, UnicodeDecodeError, NaN, over-long integers
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
