"""The shape of a JSON text, read without parsing it (torch-free): how deep it nests and how many
arrays, objects and separators it holds outside strings.

A string runs from a quote to the next quote that is not escaped (one after an odd run of
backslashes is), or to the end of the text when none closes it. Closing brackets count down even
below zero (malformed JSON, which a parser refuses anyway). The scan is linear in the text's size
whatever its bytes: escaped backslashes and quotes go with ``bytes.replace``, everything but
quotes, brackets and separators with ``bytes.translate``, and what is left is counted by numpy a
window at a time (each call short, memory bounded). No regular expression, nothing to backtrack.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

# Quotes, brackets (objects' braces read as arrays' brackets) and separators (colons read as commas).
_AS_MARKS = bytes.maketrans(b"{}:", b"[],")
_NOT_MARKS = bytes(sorted(set(range(256)) - set(b'"[]{},:')))
_QUOTE, _OPEN, _SEPARATOR = b'"[,'
# A mark's step in depth: +1 for "[", -1 for "]", 0 for the others.
_STEP = np.zeros(256, dtype=np.int8)
_STEP[b"["[0]], _STEP[b"]"[0]] = 1, -1
# The scan works through this many marks at a time.
_SCAN_WINDOW = 1 << 18


class JSONShape(NamedTuple):
    """What a JSON text holds outside its strings."""

    depth: int              # the deepest nesting of arrays and objects (0: a scalar)
    containers: int         # arrays and objects
    separators: int         # commas and colons


def json_shape(raw: bytes) -> JSONShape:
    """The shape of the JSON text ``raw`` (any bytes: a malformed text gets a shape too)."""
    if b"\\" in raw:
        # A run of backslashes loses its pairs (each an escaped backslash); one left before a quote
        # escapes it, and both go. Every quote left opens or closes a string.
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    marks = np.frombuffer(raw.translate(_AS_MARKS, _NOT_MARKS), dtype=np.uint8)
    depth = deepest = containers = separators = in_string = 0
    for start in range(0, len(marks), _SCAN_WINDOW):
        window = marks[start:start + _SCAN_WINDOW]
        steps, opens, seps = _STEP[window], window == _OPEN, window == _SEPARATOR
        if in_string or (window == _QUOTE).any():
            # Odd after an odd number of quotes (the one opening a string included): in a string.
            inside = np.cumsum(window == _QUOTE, dtype=np.uint8)
            inside += in_string
            inside &= 1
            in_string = int(inside[-1])
            outside = inside == 0
            steps = np.where(outside, steps, np.int8(0))
            opens &= outside
            seps &= outside
        depths = np.cumsum(steps, dtype=np.int32)
        deepest = max(deepest, depth + int(depths.max()))
        depth += int(depths[-1])
        containers += int(np.count_nonzero(opens))
        separators += int(np.count_nonzero(seps))
    return JSONShape(deepest, containers, separators)


def nesting_exceeds(raw: bytes, limit: int) -> bool:
    """True when the JSON text ``raw`` nests arrays and objects deeper than ``limit`` (>= 0)."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False                    # the common case: too few brackets to nest that deep
    return json_shape(raw).depth > limit
