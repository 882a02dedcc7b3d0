"""KV retention priorities (torch-free plain data): how long and how firmly a request's blocks stay
cached once nobody holds them, shaped after TensorRT-LLM's ``KvCacheRetentionConfig``.

Every cached block has a priority in [0, 100] (``DEFAULT_PRIORITY`` unless a request said
otherwise). When the device pool needs a block, it evicts the lowest priority first and, within a
priority, the least recently used. A priority given with a duration falls back to the default when
the duration ends. Blocks below ``--offload-min-priority`` are not written to the lower tiers.

A request's ``RetentionSpec`` gives token ranges of its prompt a priority (and optionally a
duration) and its generated tokens a decode priority. A block's priority is the highest of the
ranges that overlap it (the ranges a client sends may not overlap, but the server adds its own:
pins); a block that holds generated tokens takes the decode priority when that is higher.

Pins are priorities, not a second mechanism: a session's held blocks, an Anthropic
``cache_control`` breakpoint and OpenAI's ``prompt_cache_retention`` become a range
``[0, tokens)`` at ``PINNED_PRIORITY`` for the pin's TTL (``RetentionSpec.with_pin``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

MIN_PRIORITY = 0
MAX_PRIORITY = 100
# TensorRT-LLM's default: every block a request did not give a priority.
DEFAULT_PRIORITY = 35
# Sessions' and explicit cache pins' blocks, for their TTL.
PINNED_PRIORITY = 80
# At most this many token ranges in one request's spec (a client's, before the server's pins).
MAX_RETENTION_RANGES = 64
# A duration longer than this is refused (about ten years: effectively "until evicted").
MAX_DURATION_S = 10 * 365 * 86400.0


class RetentionError(ValueError):
    """A retention field outside its bounds; the message names the field (``param``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class RetentionRange:
    """Tokens ``[start, end)`` of the prompt (``end`` None: to the end of the sequence) at ``priority``,
    for ``duration_s`` seconds after the block is last freed (None: until evicted)."""

    start: int
    end: int | None
    priority: int
    duration_s: float | None = None

    def overlaps(self, lo: int, hi: int) -> bool:
        """Whether the range shares a token with ``[lo, hi)``."""
        return self.start < hi and (self.end is None or lo < self.end)


@dataclass(frozen=True)
class BlockRetention:
    """What one block is kept with: its priority and for how long (None: until evicted)."""

    priority: int = DEFAULT_PRIORITY
    duration_s: float | None = None


DEFAULT_RETENTION = BlockRetention()


@dataclass(frozen=True)
class RetentionSpec:
    """One request's retention: prompt token ranges and the priority of its generated tokens."""

    ranges: tuple[RetentionRange, ...] = ()
    decode_priority: int = DEFAULT_PRIORITY
    decode_duration_s: float | None = None

    def block_retention(self, start: int, end: int, num_prompt_tokens: int) -> BlockRetention:
        """The retention of the block holding tokens ``[start, end)`` of a request whose prompt is
        ``num_prompt_tokens`` long: the highest overlapping range's (its longest duration among equals),
        or the decode priority when the block holds generated tokens and that is higher."""
        best: BlockRetention | None = None
        for r in self.ranges:
            if r.overlaps(start, end):
                best = _stronger(best, BlockRetention(r.priority, r.duration_s))
        if end > num_prompt_tokens:
            best = _stronger(best, BlockRetention(self.decode_priority, self.decode_duration_s))
        return best or DEFAULT_RETENTION

    def with_pin(self, num_tokens: int, duration_s: float | None,
                 priority: int = PINNED_PRIORITY) -> RetentionSpec:
        """This spec plus a pin of tokens ``[0, num_tokens)`` at ``priority`` for ``duration_s``."""
        if num_tokens <= 0:
            return self
        pin = RetentionRange(0, num_tokens, priority, duration_s)
        return RetentionSpec(self.ranges + (pin,), self.decode_priority, self.decode_duration_s)


def _stronger(a: BlockRetention | None, b: BlockRetention) -> BlockRetention:
    """The higher priority of two; between equal ones, the longer duration (None is longest)."""
    if a is None or b.priority > a.priority:
        return b
    if b.priority < a.priority:
        return a
    if a.duration_s is None or b.duration_s is None:
        return BlockRetention(a.priority, None)
    return BlockRetention(a.priority, max(a.duration_s, b.duration_s))


def pin_only(num_tokens: int, duration_s: float | None, priority: int = PINNED_PRIORITY) -> RetentionSpec:
    """A spec that pins tokens ``[0, num_tokens)`` and leaves everything else at the default."""
    return RetentionSpec().with_pin(num_tokens, duration_s, priority)


# ---------------------------------------------------------------------------------- parsing

def parse_retention(body: object, param: str = "kv_cache_retention_config") -> RetentionSpec:
    """A client's ``kv_cache_retention_config`` (TensorRT-LLM's field names) as a RetentionSpec.

    ``{"token_range_retention_configs": [{"token_start": 0, "token_end": 512, "priority": 90,
    "duration_ms": 60000}], "decode_retention_priority": 35, "decode_duration_ms": null}``.
    RetentionError naming the field for: an unknown key, a priority outside [0, 100], a negative or
    non-integer token bound, ``token_end <= token_start``, overlapping ranges, more than
    MAX_RETENTION_RANGES ranges, a duration that is not a positive number of milliseconds or is
    longer than MAX_DURATION_S. Whether a range lies inside the prompt is checked by the caller,
    which knows the prompt's length (``check_ranges_within``).
    """
    if not isinstance(body, Mapping):
        raise RetentionError(f"'{param}' must be an object", param)
    allowed = {"token_range_retention_configs", "decode_retention_priority", "decode_duration_ms"}
    for key in body:
        if key not in allowed:
            raise RetentionError(f"'{param}.{key}' is not a retention field; expected one of "
                                 f"{', '.join(sorted(allowed))}", f"{param}.{key}")
    raw_ranges = body.get("token_range_retention_configs") or []
    if not isinstance(raw_ranges, list):
        raise RetentionError(f"'{param}.token_range_retention_configs' must be a list",
                             f"{param}.token_range_retention_configs")
    if len(raw_ranges) > MAX_RETENTION_RANGES:
        raise RetentionError(f"'{param}.token_range_retention_configs' holds at most {MAX_RETENTION_RANGES} "
                             f"ranges, got {len(raw_ranges)}", f"{param}.token_range_retention_configs")
    ranges = [_parse_range(item, f"{param}.token_range_retention_configs[{i}]") for i, item in enumerate(raw_ranges)]
    ordered = sorted(ranges, key=lambda r: r.start)
    for a, b in zip(ordered, ordered[1:], strict=False):
        if a.end is None or a.end > b.start:
            raise RetentionError(f"'{param}.token_range_retention_configs' ranges overlap: "
                                 f"[{a.start}, {a.end}) and [{b.start}, {b.end})",
                                 f"{param}.token_range_retention_configs")
    decode_priority = DEFAULT_PRIORITY
    if body.get("decode_retention_priority") is not None:
        decode_priority = _priority(body["decode_retention_priority"], f"{param}.decode_retention_priority")
    decode_duration = _duration(body.get("decode_duration_ms"), f"{param}.decode_duration_ms")
    return RetentionSpec(tuple(ordered), decode_priority, decode_duration)


def check_ranges_within(spec: RetentionSpec, num_prompt_tokens: int,
                        param: str = "kv_cache_retention_config") -> None:
    """RetentionError when a range starts at or past the end of the prompt (or ends past it)."""
    for r in spec.ranges:
        if r.start >= num_prompt_tokens or (r.end is not None and r.end > num_prompt_tokens):
            raise RetentionError(f"'{param}.token_range_retention_configs' range [{r.start}, {r.end}) lies "
                                 f"outside the prompt's {num_prompt_tokens} tokens",
                                 f"{param}.token_range_retention_configs")


def cap_durations(spec: RetentionSpec, max_duration_s: float, param: str = "kv_cache_retention_config"
                  ) -> RetentionSpec:
    """The spec within the server's longest retention (``--max-session-ttl``): RetentionError for a
    duration longer than ``max_duration_s``; a priority above the default given without a duration
    lasts ``max_duration_s`` (one caller cannot raise blocks above everyone's for good)."""
    def capped(priority: int, duration_s: float | None, field: str) -> float | None:
        if duration_s is not None and duration_s > max_duration_s:
            raise RetentionError(f"'{field}' is {duration_s * 1000:.0f} ms; this server keeps a retention at most "
                                 f"{max_duration_s * 1000:.0f} ms (--max-session-ttl)", field)
        if duration_s is None and priority > DEFAULT_PRIORITY:
            return max_duration_s
        return duration_s

    ranges_param = f"{param}.token_range_retention_configs"
    ranges = tuple(RetentionRange(r.start, r.end, r.priority, capped(r.priority, r.duration_s,
                                                                       f"{ranges_param}[{i}].duration_ms"))
                   for i, r in enumerate(spec.ranges))
    decode = capped(spec.decode_priority, spec.decode_duration_s, f"{param}.decode_duration_ms")
    return RetentionSpec(ranges, spec.decode_priority, decode)


def _parse_range(item: object, param: str) -> RetentionRange:
    if not isinstance(item, Mapping):
        raise RetentionError(f"'{param}' must be an object", param)
    for key in item:
        if key not in ("token_start", "token_end", "priority", "duration_ms"):
            raise RetentionError(f"'{param}.{key}' is not a range field; expected token_start, token_end, "
                                 f"priority, duration_ms", f"{param}.{key}")
    start = _token(item.get("token_start", 0), f"{param}.token_start")
    end = None if item.get("token_end") is None else _token(item["token_end"], f"{param}.token_end")
    if end is not None and end <= start:
        raise RetentionError(f"'{param}': token_end {end} must be greater than token_start {start}", param)
    if "priority" not in item:
        raise RetentionError(f"'{param}.priority' is required", f"{param}.priority")
    return RetentionRange(start, end, _priority(item["priority"], f"{param}.priority"),
                          _duration(item.get("duration_ms"), f"{param}.duration_ms"))


def _token(value: object, param: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RetentionError(f"'{param}' must be a whole number >= 0, got {value!r}", param)
    return value


def _priority(value: object, param: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not MIN_PRIORITY <= value <= MAX_PRIORITY:
        raise RetentionError(f"'{param}' must be a whole number in [{MIN_PRIORITY}, {MAX_PRIORITY}], "
                             f"got {value!r}", param)
    return value


def _duration(value: object, param: str) -> float | None:
    """Milliseconds from the client, seconds here; None stays None (until evicted)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise RetentionError(f"'{param}' must be a positive number of milliseconds, got {value!r}", param)
    if value / 1000.0 > MAX_DURATION_S:
        raise RetentionError(f"'{param}' is longer than {MAX_DURATION_S:.0f} s", param)
    return value / 1000.0
