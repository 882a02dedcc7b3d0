"""Hostile request bodies: JSON (and not-JSON) built to make a body check slow, deep or crash.

``hostile_bodies(size)`` maps a class name to a body of at most ``size`` bytes (most of them close
to it). Every body is one no route takes: a route answers it 400 (or 413 over its limit), whatever
route it is sent to. Valid JSON objects carry fields each route refuses (``messages`` and ``input``
are no lists, and ``prompt`` sits beside ``messages``), so the hostile part is parsed and
validated before the refusal, as a real request's would be.
"""

from __future__ import annotations

from collections.abc import Callable

MAX_DEPTH = 64                      # kvhive.core.json_body.MAX_JSON_DEPTH, as a client knows it

# Fields every route refuses; the hostile value is the ``prompt`` that follows them.
_PREFIX = b'{"messages": 0, "input": 0, "prompt": '
_SUFFIX = b"}"


# More openers than MAX_DEPTH, one level deep: a body a depth check cannot pass over by counting.
_MANY_BRACKETS = b"[]," * (MAX_DEPTH + 1)


def _wrapped(payload: bytes) -> bytes:
    return _PREFIX + payload + _SUFFIX


def _repeat(unit: bytes, size: int) -> bytes:
    return unit * max(0, size // len(unit))


def _fitted(head: bytes, unit: bytes, tail: bytes, size: int) -> bytes:
    """``head`` + ``unit`` repeated + ``tail``: as long as fits in ``size`` bytes with the wrapper."""
    room = size - len(_PREFIX) - len(_SUFFIX) - len(head) - len(tail)
    return _wrapped(head + _repeat(unit, room) + tail)


def _open(head: bytes, unit: bytes, tail: bytes, size: int) -> bytes:
    """An object that never closes: the prefix, ``head``, ``unit`` repeated, ``tail``."""
    room = size - len(_PREFIX) - len(head) - len(tail)
    return _PREFIX + head + _repeat(unit, room) + tail


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"1" + b"]" * depth


def _many_keys(size: int) -> bytes:
    keys, total, i = [], 2, 0
    while total < size - 64:
        key = b'"k%d": 0' % i
        keys.append(key)
        total += len(key) + 2
        i += 1
    return b'{"messages": 0, "input": 0, ' + b", ".join(keys) + b"}"


def _long_key(size: int, value: bytes = b"0") -> bytes:
    room = size - 64 - len(value)
    return b'{"messages": 0, "input": 0, "' + b"k" * room + b'": ' + value + b"}"


def _surrogate_under_long_key(size: int) -> bytes:
    """A long key holding many short strings, the last of them a lone surrogate: a path per string
    that repeats the key would cost the key's length each."""
    key = b"k" * (size // 2)
    items = _repeat(b'"a", ', size // 2 - 64)
    return b'{"messages": 0, "input": 0, "' + key + b'": [' + items + b'"\\ud800"]}'


def _sized(name: str, size: int) -> bytes:
    builders: dict[str, Callable[[int], bytes]] = {
        # Strings that never close: with escaped quotes (each one a place a string could start),
        # without, and ending in a lone backslash.
        "unterminated_string": lambda n: _open(b'"', b"a", b"", n),
        "unterminated_escaped_quotes": lambda n: (_MANY_BRACKETS + b'"' + _repeat(b'\\"', n))[:n],
        "unterminated_escaped_quotes_in_object": lambda n: _open(_MANY_BRACKETS + b'"', b'\\"', b"", n),
        "unterminated_brackets_in_string": lambda n: _open(b'"', b'[{\\"', b"", n),
        "unterminated_trailing_backslash": lambda n: _open(b'"', b"a", b"\\", n),
        # Long runs of escapes: backslashes, quotes, \u escapes, surrogate pairs, lone surrogates.
        "escaped_backslashes": lambda n: _fitted(b'"', b"\\\\", b'"', n),
        "escaped_quotes": lambda n: _fitted(b'"', b'\\"', b'"', n),
        "unicode_escapes": lambda n: _fitted(b'"', b"\\u00e9", b'"', n),
        "surrogate_pairs": lambda n: _fitted(b'"', b"\\ud83d\\ude00", b'"', n),
        "lone_surrogates": lambda n: _fitted(b'"', b"\\ud800", b'"', n),
        "surrogate_under_long_key": _surrogate_under_long_key,
        # Nesting: deep, and brackets that only look deep (in strings, or closed at once).
        "open_brackets": lambda n: b"[" * n,
        "open_objects": lambda n: _repeat(b'{"a":', n),
        "deep_in_strings": lambda n: _fitted(b'"', b"[[{{", b'"', n),
        "flat_brackets": lambda n: _fitted(b"[", b"[],", b"[]]", n),
        # Numbers: long integers and floats, exponents out of range.
        "long_integer": lambda n: _fitted(b"", b"9", b"", n),
        "long_float": lambda n: _fitted(b"0.", b"1", b"", n),
        "long_exponent_float": lambda n: _fitted(b"1.", b"5", b"e999999", n),
        "many_long_integers": lambda n: _fitted(b"[", b"9" * 4000 + b",", b"1]", n),
        # Strings that are not UTF-8, or hold control characters.
        "invalid_utf8": lambda n: _fitted(b'"', b"\xff\xfe", b'"', n),
        "encoded_surrogates": lambda n: _fitted(b'"', b"\xed\xa0\x80", b'"', n),
        "control_characters": lambda n: _fitted(b'"', b"a\x00", b'"', n),
        # Shapes: a long key, many keys, many small objects, many small strings.
        "long_key": _long_key,
        "many_keys": _many_keys,
        "many_small_objects": lambda n: _fitted(b"[", b"{}, ", b"{}]", n),
        "many_small_strings": lambda n: _fitted(b"[", b'"", ', b'""]', n),
        "whitespace_padding": lambda n: _fitted(b"", b" ", b"1", n),
    }
    return builders[name](size)


SIZED = ("unterminated_string", "unterminated_escaped_quotes", "unterminated_escaped_quotes_in_object",
         "unterminated_brackets_in_string", "unterminated_trailing_backslash", "escaped_backslashes",
         "escaped_quotes", "unicode_escapes", "surrogate_pairs", "lone_surrogates",
         "surrogate_under_long_key", "open_brackets", "open_objects", "deep_in_strings", "flat_brackets",
         "long_integer", "long_float", "long_exponent_float", "many_long_integers", "invalid_utf8",
         "encoded_surrogates", "control_characters", "long_key", "many_keys", "many_small_objects",
         "many_small_strings", "whitespace_padding")

# Small bodies whose shape, not their size, is the point.
FIXED: dict[str, bytes] = {
    "empty": b"",
    "whitespace": b" \r\n\t ",
    "array_top_level": b'[{"prompt": "hi"}]',
    "string_top_level": b'"hi"',
    "number_top_level": b"42",
    "null_top_level": b"null",
    "nan": _wrapped(b"NaN"),
    "infinity": _wrapped(b"-Infinity"),
    "exponent_overflow": b'{"prompt": "hi", "messages": 0, "temperature": 1e999}',
    "depth_over_limit": _wrapped(_nested(MAX_DEPTH)),
    "depth_at_limit": _wrapped(_nested(MAX_DEPTH - 1)),
    "truncated": b'{"prompt": ',
    "byte_order_mark": b"\xef\xbb\xbf" + _wrapped(b'"hi"'),
    "lone_surrogate_key": b'{"messages": 0, "input": 0, "\\udc00": 1}',
}


def hostile_bodies(size: int) -> dict[str, bytes]:
    """Every hostile class: the sized ones at about ``size`` bytes (at most), and the fixed ones."""
    bodies = {name: _sized(name, size) for name in SIZED}
    assert all(len(body) <= size for body in bodies.values()), {k: len(v) for k, v in bodies.items()}
    return {**bodies, **FIXED}
