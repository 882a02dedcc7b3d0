"""The body checks of ``kvhive.core.json_body`` in process: the nesting scan agrees with a
character-by-character reference (hypothesis, on JSON and on arbitrary bytes), its edge cases
exactly, and every hostile class of ``support.hostile_bodies`` is a BodyError (never another
exception) or a JSON object."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.hostile_bodies import hostile_bodies

from kvhive.core import json_shape
from kvhive.core.json_body import (
    MAX_INT_DIGITS,
    MAX_JSON_CONTAINERS,
    MAX_JSON_DEPTH,
    MAX_JSON_ITEMS,
    BodyError,
    MalformedJSON,
    json_object,
    load_json,
    lone_surrogate_param,
    nesting_exceeds,
)
from kvhive.core.json_shape import JSONShape


def reference_shape(raw: bytes) -> JSONShape:
    """The shape of ``raw``, one byte at a time: a quote after an even run of backslashes opens or
    closes a string; brackets and separators outside strings count (closing ones below zero too)."""
    depth = deepest = containers = separators = backslashes = 0
    in_string = False
    for byte in raw:
        if byte == ord("\\"):
            backslashes += 1
            continue
        if byte == ord('"') and backslashes % 2 == 0:
            in_string = not in_string
        elif not in_string and byte in b"[{":
            depth += 1
            containers += 1
            deepest = max(deepest, depth)
        elif not in_string and byte in b"]}":
            depth -= 1
        elif not in_string and byte in b",:":
            separators += 1
        backslashes = 0
    return JSONShape(deepest, containers, separators)


def reference_depth(raw: bytes) -> int:
    return reference_shape(raw).depth


def parsed_depth(value: Any) -> int:
    """The nesting of parsed JSON ``value``."""
    if isinstance(value, list):
        return 1 + max((parsed_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((parsed_depth(v) for v in value.values()), default=0)
    return 0


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='ab"\\[]{}\u00e9\n', max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(alphabet='k"\\[{', max_size=4), inner,
                                                                max_size=4),
    max_leaves=40)
# Bytes that matter to the scan, and a filler.
scan_bytes = st.binary(max_size=300).map(lambda b: bytes(b'[]{}"\\a,:'[x % 9] for x in b))


@settings(max_examples=400, deadline=None)
@given(json_values, st.sampled_from([False, True]))
def test_the_scan_agrees_with_the_parsed_depth(value: Any, ascii_only: bool) -> None:
    raw = json.dumps(value, ensure_ascii=ascii_only).encode()
    depth = parsed_depth(value)
    assert reference_depth(raw) == depth
    for limit in {0, max(0, depth - 1), depth, depth + 1}:
        assert nesting_exceeds(raw, limit) == (depth > limit)


@settings(max_examples=400, deadline=None)
@given(scan_bytes, st.integers(0, 6))
def test_the_scan_agrees_with_the_reference_on_any_bytes(raw: bytes, limit: int) -> None:
    assert json_shape.json_shape(raw) == reference_shape(raw)
    assert nesting_exceeds(raw, limit) == (reference_depth(raw) > limit)


@settings(max_examples=100, deadline=None)
@given(scan_bytes, st.integers(0, 6), st.integers(1, 5))
def test_windows_carry_depth_and_strings(raw: bytes, limit: int, window: int) -> None:
    whole = json_shape._SCAN_WINDOW
    json_shape._SCAN_WINDOW = window
    try:
        assert json_shape.json_shape(raw) == reference_shape(raw)
        assert nesting_exceeds(raw, limit) == (reference_depth(raw) > limit)
    finally:
        json_shape._SCAN_WINDOW = whole


@pytest.mark.parametrize("raw,deepest", [
    (b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH, MAX_JSON_DEPTH),
    (b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1), MAX_JSON_DEPTH + 1),
    (b"[" * (MAX_JSON_DEPTH + 1), MAX_JSON_DEPTH + 1),                  # never closed
    (b"[]," * 100, 1),                                                  # many brackets, shallow
    (b'"' + b"[" * 100, 0),                                             # a string never closed
    (b'"\\"' + b"[" * 100, 0),                                          # ... after an escaped quote
    (b'"\\\\"' + b"[" * 100, 100),                                      # an escaped backslash closes it
    (b'"\\\\\\"' + b"[" * 100, 0),                                      # three: the quote is escaped
    (b'["' + b"[" * 100 + b'\\', 1),                                    # a trailing backslash
    (b'{"a' + b"\\" * 7 + b'"b": [' + b"{" * 80, 82),                   # an odd run escapes the quote
    (b'{"a' + b"\\" * 6 + b'"b": [' + b"{" * 80, 1),                    # an even one does not
    (b"]" * 10 + b"[" * 70, 60),                                        # below zero, then up
    (b'["\\u005b\\u007b"' + b",[]" * 70 + b"]", 2),                    # escaped brackets are text
])
def test_nesting_edge_cases(raw: bytes, deepest: int) -> None:
    assert reference_depth(raw) == deepest
    assert nesting_exceeds(raw) == (deepest > MAX_JSON_DEPTH)


def test_depth_at_the_limit_parses_and_over_it_is_refused() -> None:
    assert parsed_depth(load_json(b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH)) == MAX_JSON_DEPTH
    with pytest.raises(BodyError, match="deeper than") as caught:
        load_json(b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1))
    assert not isinstance(caught.value, MalformedJSON)


def test_bodies_that_would_build_too_much_are_refused() -> None:
    at_most = b"[" + b"[]," * (MAX_JSON_CONTAINERS - 2) + b"[]]"
    assert len(load_json(at_most)) == MAX_JSON_CONTAINERS - 1
    with pytest.raises(BodyError, match=f"{MAX_JSON_CONTAINERS + 1} arrays and objects") as caught:
        load_json(b"[" + b"{}," * (MAX_JSON_CONTAINERS - 1) + b"{}]")
    assert not isinstance(caught.value, MalformedJSON)
    items = b"[" + b"1," * (MAX_JSON_ITEMS - 2) + b"1]"     # one array, MAX_JSON_ITEMS - 2 commas
    assert len(load_json(items)) == MAX_JSON_ITEMS - 1
    with pytest.raises(BodyError, match=f"at most {MAX_JSON_ITEMS}"):
        load_json(b'{"a": [' + b"1," * MAX_JSON_ITEMS + b"1]}")
    # Separators and brackets in strings are text.
    assert load_json(b'{"p": "' + b",:[{" * MAX_JSON_ITEMS + b'"}')["p"][:4] == ",:[{"


@pytest.mark.parametrize("raw,match", [
    (b'{"t": 1e999}', "out of range"), (b'{"t": -1.5e400}', "out of range"),
    (b'{"t": NaN}', "NaN"), (b'{"n": ' + b"9" * 5000 + b"}", "5000 digits"),
    (b'{"n": [1, -' + b"9" * (MAX_INT_DIGITS + 1) + b"]}", f"at most {MAX_INT_DIGITS}"),
    (b'{"p": "\xff"}', "utf-8"), (b'{"p": "\xed\xa0\x80"}', "utf-8"), (b'{"p": "a\x00"}', "control"),
    (b"\xef\xbb\xbf{}", "BOM"), (b'{"p": "abc', "Unterminated"),
])
def test_values_python_takes_but_json_does_not(raw: bytes, match: str) -> None:
    with pytest.raises(MalformedJSON, match=match):
        load_json(raw)


def test_numbers_in_range_parse() -> None:
    data = load_json(b'{"t": 1e308, "u": 1e-999, "n": -' + b"9" * MAX_INT_DIGITS + b', "s": "' + b"9" * 5000 + b'"}')
    assert data["t"] == 1e308 and data["n"] == -(10 ** MAX_INT_DIGITS - 1) and len(data["s"]) == 5000
    assert load_json(b"[" + b"12345," * 1000 + b"1]")[999] == 12345


def test_the_lone_surrogate_path_is_written_once_and_shown_safely() -> None:
    key = "k" * 100_000
    data = {key: ["a"] * 100_000 + ["\ud800"]}
    path = lone_surrogate_param(data)
    assert path == "k" * 61 + "...[100000]"
    assert lone_surrogate_param({"m": {"\udc00x": 1}}) == "m.\\udc00x"
    assert lone_surrogate_param({"m": [{"ok": "😀"}]}) is None
    with pytest.raises(BodyError) as caught:
        load_json(b'{"\\udc00": 1}')
    assert caught.value.param == "\\udc00"
    caught.value.message.encode("utf-8")            # the answer can carry it


@pytest.mark.parametrize("name,body", sorted(hostile_bodies(1 << 16).items()))
def test_hostile_bodies_are_body_errors_or_objects(name: str, body: bytes) -> None:
    try:
        data = json_object(body)
    except BodyError as exc:
        exc.message.encode("utf-8")
        assert exc.param is None or isinstance(exc.param, str)
        return
    assert isinstance(data, dict), name
