"""The per-key KV limit (--max-pinned-gb): as set, none, or by default half the room sessions may
pin (the keeper tier's session share, else the device pool); bounds checked; 429 kinds above it."""

from __future__ import annotations

import math

import pytest
from support.sessions import BLOCK_BYTES, BLOCK_SIZE, hashes, registry, run_turn

from kvhive.cli import parse_args
from kvhive.config import PINNED_AUTO, SessionConfig
from kvhive.sessions.limits import KEY_PINNED_SHARE, KeeperTier, key_pinned_limit
from kvhive.sessions.registry import SessionLimit, SessionRegistry

AUTO = SessionConfig(max_ttl_s=3600)
POOL_BYTES = 40 * BLOCK_BYTES


def test_the_default_is_half_the_keeper_tier_s_session_room_else_half_the_device_pool():
    assert AUTO.max_pinned_gb == PINNED_AUTO and KEY_PINNED_SHARE == 0.5
    keeper = KeeperTier("disk", 100 * BLOCK_BYTES, "--disk-cache-gb 0.001")
    on_disk = key_pinned_limit(AUTO, keeper, POOL_BYTES)
    assert on_disk.num_bytes == 45 * BLOCK_BYTES                     # half of the 90 blocks sessions may pin
    assert on_disk.source == "--max-pinned-gb auto: 50% of what sessions may pin in the disk tier, 720.0 KiB"
    on_device = key_pinned_limit(AUTO, None, POOL_BYTES)
    assert on_device.num_bytes == 20 * BLOCK_BYTES
    assert on_device.source == "--max-pinned-gb auto: 50% of the device KV pool, 320.0 KiB"
    assert key_pinned_limit(AUTO, None, None) is None                 # nothing to take a share of
    assert key_pinned_limit(SessionConfig(max_pinned_gb=None), keeper, POOL_BYTES) is None
    set_ = key_pinned_limit(SessionConfig(max_pinned_gb=2), keeper, POOL_BYTES)
    assert (set_.num_bytes, set_.source) == (2 << 30, "--max-pinned-gb 2")


def test_one_key_over_half_the_pool_gets_429_and_another_key_still_fits():
    reg = SessionRegistry(AUTO, BLOCK_BYTES, BLOCK_SIZE, device_pool_bytes=POOL_BYTES)
    run_turn(reg, "k1", hashes("a", 12))                              # 12 blocks' tokens + 3
    with pytest.raises(SessionLimit) as over:
        reg.check_pinned("k1", 8 * BLOCK_SIZE)                        # 20 blocks + 3 tokens > 20
    assert over.value.code == "session_kv_limit"
    assert "(--max-pinned-gb auto: 50% of the device KV pool, 320.0 KiB)" in over.value.message
    reg.check_pinned("k1", 8 * BLOCK_SIZE - 3)                        # exactly 20 blocks' worth fits
    reg.check_pinned("k2", 20 * BLOCK_SIZE)                           # the other half is another key's


def test_the_default_leaves_a_server_without_api_keys_alone_but_a_set_limit_does_not():
    unkeyed = SessionRegistry(AUTO, BLOCK_BYTES, BLOCK_SIZE, device_pool_bytes=POOL_BYTES)
    run_turn(unkeyed, None, hashes("a", 100))
    unkeyed.check_pinned(None, 100 * BLOCK_SIZE)                      # one tenant: no share to keep
    set_ = SessionConfig(max_ttl_s=3600, max_pinned_gb=30 * BLOCK_BYTES / 2**30)
    limited = SessionRegistry(set_, BLOCK_BYTES, BLOCK_SIZE, device_pool_bytes=POOL_BYTES)
    run_turn(limited, None, hashes("a", 20))
    with pytest.raises(SessionLimit, match=r"\(--max-pinned-gb 0\.000228882\)"):
        limited.check_pinned(None, 11 * BLOCK_SIZE)


def test_none_means_no_per_key_limit():
    reg = registry()                                                  # max_pinned_gb=None
    run_turn(reg, "k1", hashes("a", 1000))
    reg.check_pinned("k1", 10**6)


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan, "half"])
def test_config_refuses_a_limit_that_is_not_positive_auto_or_none(bad):
    with pytest.raises(ValueError, match="--max-pinned-gb"):
        SessionConfig(max_pinned_gb=bad)


def test_the_flag_takes_gib_auto_or_none_and_exits_2_on_anything_else(capsys):
    assert parse_args(["serve"]).max_pinned_gb == PINNED_AUTO
    assert parse_args(["serve", "--max-pinned-gb", "auto"]).max_pinned_gb == PINNED_AUTO
    assert parse_args(["serve", "--max-pinned-gb", "none"]).max_pinned_gb is None
    assert parse_args(["serve", "--max-pinned-gb", "0.25"]).max_pinned_gb == 0.25
    for bad in ("0", "-2", "inf", "nan", "lots"):
        with pytest.raises(SystemExit) as exited:
            parse_args(["serve", "--max-pinned-gb", bad])
        assert exited.value.code == 2
        assert "--max-pinned-gb" in capsys.readouterr().err
