"""The client's retention spec (``kvhive.core.retention``): parsing bounds, the block retention a
spec gives, pins added on top, and durations held within the server's longest retention."""

from __future__ import annotations

import pytest

from kvhive.core.retention import (
    DEFAULT_PRIORITY,
    PINNED_PRIORITY,
    RetentionError,
    cap_durations,
    check_ranges_within,
    parse_retention,
)


def ranges(*items: dict) -> dict:
    return {"token_range_retention_configs": list(items)}


def test_a_block_takes_the_highest_overlapping_range_and_decode_blocks_the_decode_priority() -> None:
    spec = parse_retention({**ranges({"token_start": 0, "token_end": 32, "priority": 90, "duration_ms": 2000},
                                     {"token_start": 32, "token_end": 40, "priority": 10}),
                            "decode_retention_priority": 60})
    assert spec.block_retention(0, 16, 48).priority == 90
    assert spec.block_retention(0, 16, 48).duration_s == 2.0
    assert spec.block_retention(32, 48, 48).priority == 10          # all prompt, only the low range
    assert spec.block_retention(40, 56, 48).priority == 60          # holds generated tokens
    assert spec.block_retention(96, 112, 200).priority == DEFAULT_PRIORITY
    pinned = spec.with_pin(40, 300.0)
    assert pinned.block_retention(32, 48, 48).priority == PINNED_PRIORITY
    assert pinned.block_retention(0, 16, 48).priority == 90           # a stronger range stays


@pytest.mark.parametrize("body, param", [
    (ranges({"token_start": 0, "token_end": 8, "priority": 101}), "priority"),
    (ranges({"token_start": 0, "token_end": 8, "priority": -1}), "priority"),
    (ranges({"token_start": 8, "token_end": 8, "priority": 50}), "token_range_retention_configs[0]"),
    (ranges({"token_start": 0, "token_end": 16, "priority": 50}, {"token_start": 8, "priority": 60}),
     "token_range_retention_configs"),
    (ranges({"token_start": 0, "priority": 50, "duration_ms": 0}), "duration_ms"),
    (ranges({"token_start": 0, "priority": 50, "weight": 1}), "weight"),
    ({"decode_retention_priority": True}, "decode_retention_priority"),
    ({"retain": 1}, "retain"),
])
def test_bad_specs_are_refused_naming_the_field(body: dict, param: str) -> None:
    with pytest.raises(RetentionError) as err:
        parse_retention(body)
    assert param in err.value.param


def test_ranges_must_lie_inside_the_prompt() -> None:
    spec = parse_retention(ranges({"token_start": 0, "token_end": 64, "priority": 50}))
    check_ranges_within(spec, 64)
    with pytest.raises(RetentionError):
        check_ranges_within(spec, 63)


def test_durations_are_held_within_the_server_cap() -> None:
    spec = parse_retention({**ranges({"token_start": 0, "token_end": 8, "priority": 90},
                                     {"token_start": 8, "token_end": 16, "priority": 20},
                                     {"token_start": 16, "token_end": 24, "priority": 70, "duration_ms": 5000}),
                            "decode_retention_priority": 50})
    capped = cap_durations(spec, 600.0)
    assert [r.duration_s for r in capped.ranges] == [600.0, None, 5.0]   # high without a duration: the cap
    assert capped.decode_duration_s == 600.0
    with pytest.raises(RetentionError) as err:
        cap_durations(spec, 4.0)
    assert err.value.param.endswith("[2].duration_ms")
