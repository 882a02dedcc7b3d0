"""Anthropic's cache breakpoints (torch-free; the replica and the gateway share it): the
``cache_control`` objects of a body checked into ``CacheBreakpoint``s, and where each falls in the
rendered prompt.

``cache_control`` may sit on a tool, a system text block, a message content block (a text block
inside a tool result marks the end of that result) or on the whole request (then it marks the last
block of the last message): at most MAX_BREAKPOINTS, type "ephemeral", TTL "5m" (the default) or
"1h", a longer TTL never after a shorter one, never on an empty text block.

A breakpoint's character offset is the common prefix of the body's rendered text and of a probe
rendered from the body changed just after the breakpointed element (``probe_body``: a sentinel
tool or system block after it, or the messages cut after the block), so the offset always ends a
true prefix of the prompt, whatever the template writes around the element. Breakpoints follow
Anthropic's order (tools, system, messages) and each covers at least the one before it: where a
template writes the tools after the system text, a breakpoint on the system covers the tools too.
``breakpoint_tokens`` turns the offsets into prompt token counts: the common prefix of the ids of
the text up to the offset and of the whole prompt's ids.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvhive.core.json_body import BodyError
from kvhive.core.tool_definitions import check_object

# Anthropic's bounds: at most 4 breakpoints, TTLs of 5 minutes (the default) or an hour.
MAX_BREAKPOINTS = 4
CACHE_TTL_S: Mapping[str, int] = {"5m": 300, "1h": 3600}
DEFAULT_TTL = "5m"
CACHE_CONTROL_KEYS = frozenset({"type", "ttl"})
# The probe text that follows a breakpointed tool or system block; never part of a real prompt.
SENTINEL = "\x00kvhive-cache-breakpoint\x00"
SENTINEL_TOOL = "kvhive_cache_breakpoint"


@dataclass(frozen=True)
class CacheBreakpoint:
    """A ``cache_control`` breakpoint: the element it ends (``where``: ("tools", i), ("system", j) or
    ("messages", k, j), j None for a message's string content), its TTL and the field naming it."""

    where: tuple[Any, ...]
    ttl_s: int
    param: str


# ---------------------------------------------------------------- checks


def cache_ttl(raw: Any, param: str) -> int:
    """A ``cache_control`` object's TTL in seconds; BodyError for another type, TTL or field."""
    check_object(raw, param, CACHE_CONTROL_KEYS)
    if raw.get("type") != "ephemeral":
        raise BodyError(f"'{param}.type' must be 'ephemeral', got {raw.get('type')!r:.40}", param=f"{param}.type")
    ttl = raw.get("ttl", DEFAULT_TTL)
    if ttl is None:
        ttl = DEFAULT_TTL
    if ttl not in CACHE_TTL_S:
        raise BodyError(f"'{param}.ttl' must be '5m' or '1h', got {ttl!r:.40}", param=f"{param}.ttl")
    return CACHE_TTL_S[ttl]


def add_breakpoint(element: Mapping[str, Any], where: tuple[Any, ...], param: str,
                    breakpoints: list[CacheBreakpoint]) -> None:
    raw = element.get("cache_control")
    if raw is None:
        return
    ttl_s = cache_ttl(raw, f"{param}.cache_control")
    if element.get("type") == "text" and element.get("text") == "":
        raise BodyError("An empty text block cannot carry cache_control", param=f"{param}.cache_control")
    breakpoints.append(CacheBreakpoint(where, ttl_s, f"{param}.cache_control"))


def top_level_breakpoint(body: Mapping[str, Any], breakpoints: list[CacheBreakpoint]) -> None:
    """The body's own ``cache_control``: a breakpoint on the last block of the last message."""
    raw = body.get("cache_control")
    if raw is None:
        return
    ttl_s = cache_ttl(raw, "cache_control")
    k = len(body["messages"]) - 1
    content = body["messages"][k]["content"]
    where = ("messages", k, None) if isinstance(content, str) else ("messages", k, len(content) - 1)
    if any(b.where == where for b in breakpoints):
        return                  # already a breakpoint: the block carries one
    breakpoints.append(CacheBreakpoint(where, ttl_s, "cache_control"))


def check_breakpoints(breakpoints: Sequence[CacheBreakpoint]) -> None:
    """At most MAX_BREAKPOINTS; a longer TTL never after a shorter one (Anthropic's rule)."""
    if len(breakpoints) > MAX_BREAKPOINTS:
        raise BodyError(f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. "
                        f"Found {len(breakpoints)}.", param=breakpoints[MAX_BREAKPOINTS].param)
    for before, after in zip(breakpoints, breakpoints[1:], strict=False):
        if after.ttl_s > before.ttl_s:
            raise BodyError("A cache_control with a longer ttl must come before those with a shorter one "
                            "(tools, then system, then messages)", param=after.param)


def add_nested_breakpoint(block: Mapping[str, Any], where: tuple[Any, ...], param: str,
                           breakpoints: list[CacheBreakpoint]) -> None:
    """A breakpoint on a text block inside a tool result's content: the tool result's own (the
    prompt is cut after the whole result)."""
    content = block.get("content")
    for m, nested in enumerate(content if isinstance(content, list) else ()):
        add_breakpoint(nested, where, f"{param}[{m}]", breakpoints)



# ---------------------------------------------------------------- placement


def probe_body(body: Mapping[str, Any], where: tuple[Any, ...]) -> dict[str, Any]:
    """``body`` changed just after the element ``where``: a sentinel tool or system block after it,
    or the messages cut after the block (no top-level ``cache_control``)."""
    probe = {k: v for k, v in body.items() if k != "cache_control"}
    kind, index = where[0], where[1]
    if kind == "tools":
        tools = list(body["tools"][:index + 1])
        names = {t.get("name") for t in tools}
        name = next(f"{SENTINEL_TOOL}_{n}" for n in range(len(names) + 1) if f"{SENTINEL_TOOL}_{n}" not in names)
        probe["tools"] = [*tools, {"name": name, "description": SENTINEL, "input_schema": {"type": "object"}}]
        probe.pop("tool_choice", None)
    elif kind == "system":
        probe["system"] = [*body["system"][:index + 1], {"type": "text", "text": SENTINEL}]
    else:
        messages = list(body["messages"][:index + 1])
        block = where[2]
        if block is not None:
            messages[index] = {**messages[index], "content": messages[index]["content"][:block + 1]}
        if messages[-1].get("role") == "assistant":
            messages.append({"role": "user", "content": SENTINEL})
        probe["messages"] = messages
    return probe


def breakpoint_chars(body: Mapping[str, Any], breakpoints: Sequence[CacheBreakpoint],
                     render: Callable[[Mapping[str, Any]], str]) -> tuple[str, list[int]]:
    """The body's rendered text (``render`` of a body: converted and through the chat template) and
    each breakpoint's character offset in it: the common prefix of the text and its probe's text,
    at least the offset before it."""
    text = render(body)
    offsets: list[int] = []           # each at least the one before: breakpoints nest in Anthropic's order
    for breakpoint in breakpoints:
        offset = common_prefix_len(text, render(probe_body(body, breakpoint.where)))
        offsets.append(max(offset, offsets[-1]) if offsets else offset)
    return text, offsets


def breakpoint_tokens(encode: Callable[[str], Sequence[int]], text: str, prompt_ids: Sequence[int],
                      offsets: Sequence[int]) -> list[int]:
    """How many prompt tokens (``prompt_ids``, the ids of ``text``) each character offset covers: the
    common prefix of ``encode(text[:offset])`` and the prompt's ids."""
    return [common_prefix_len(encode(text[:offset]), prompt_ids) if offset < len(text) else len(prompt_ids)
            for offset in offsets]


def common_prefix_len(a: Sequence[Any], b: Sequence[Any]) -> int:
    """How many leading items (characters, ids) ``a`` and ``b`` share: halving the differing span,
    compared a slice at a time (linear in the length, the comparisons in C)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    # Invariant: the first lo items agree; somewhere in [lo, hi) they differ.
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo
