"""SessionRegistry without a model: per-session records in a disk dir, and the server-wide limit of
the keeper tier."""

from __future__ import annotations

import os
import time

import pytest
from support.sessions import BLOCK_BYTES, BLOCK_SIZE, Pins, hashes, registry, run_turn

from kvhive.sessions.backends import SESSIONS_DIR, FileBackend
from kvhive.sessions.registry import KeeperTier, SessionError, SessionLimit

# ---------------------------------------------------------------- disk dir


def test_file_backend_keeps_one_record_per_session_and_reloads_them(tmp_path):
    pins = Pins()
    reg = registry(FileBackend(str(tmp_path)))
    a = run_turn(reg, "k1", hashes("a", 3), session_id="conv/../a")     # a client's id, not a path
    b = run_turn(reg, None, hashes("b", 2), ttl=1)
    files = os.listdir(tmp_path / SESSIONS_DIR)
    assert len(files) == 2 and all(f.endswith(".json") for f in files)
    time.sleep(1.1)                                                     # b expires
    again = registry(FileBackend(str(tmp_path)), pins=pins)
    got = again.get("conv/../a", "k1")
    assert (got.num_tokens, got.block_hashes, got.expires) == (a.num_tokens, a.block_hashes, a.expires)
    assert pins.calls == [(a.engine_id, a.block_hashes)]                 # the live one is pinned, once
    with pytest.raises(SessionError):
        again.get(b.session_id, None)
    assert [s.session_id for s in again.pop_expired()] == [b.session_id]   # its blocks can be freed
    assert len(os.listdir(tmp_path / SESSIONS_DIR)) == 1
    again.delete(got)
    assert os.listdir(tmp_path / SESSIONS_DIR) == []


# ---------------------------------------------------------------- the keeper tier's budget


def test_sessions_may_not_pin_more_than_the_keeper_tier_holds():
    # 20 blocks of budget, 18 for sessions after the 10% margin.
    keeper = KeeperTier("cpu", 20 * BLOCK_BYTES, "--cpu-offload-gb 0.00015")
    reg = registry(keeper=keeper)
    a = run_turn(reg, "k1", hashes("a", 8))
    run_turn(reg, "k2", hashes("b", 8))                  # keys share the tier: the limit is server-wide
    assert reg.pinned_block_bytes() == 16 * BLOCK_BYTES
    with pytest.raises(SessionError) as full:
        reg.check_pinned("k3", 3 * BLOCK_SIZE + 5)       # 3 full blocks more: 19 > 18
    err = full.value
    assert isinstance(err, SessionLimit) and err.code == "session_tier_full"
    assert err.message.startswith("The server's sessions would pin 152.0 KiB of KV in its cpu tier, "
                                  "over the 144.0 KiB it keeps for sessions (90% of --cpu-offload-gb 0.00015)")
    reg.check_pinned("k3", 2 * BLOCK_SIZE + 15)          # 2 full blocks fit: 18
    # A session's own blocks are replaced by its next turn: extending a to 10 blocks fits, 11 does not.
    reg.begin_turn(a, "m", 10 * BLOCK_SIZE)
    reg.end_turn(a, 10 * BLOCK_SIZE, hashes("a", 10))
    with pytest.raises(SessionError):
        reg.begin_turn(a, "m", 11 * BLOCK_SIZE)
    assert not a.busy and a.block_hashes == hashes("a", 10)   # refused: nothing changed
    # Blocks that sessions share count once; a deleted session gives its blocks back.
    shared = run_turn(reg, "k3", hashes("a", 2))
    assert reg.pinned_block_bytes() == 18 * BLOCK_BYTES
    reg.delete(shared)
    reg.delete(a)
    assert reg.pinned_block_bytes() == 8 * BLOCK_BYTES
    reg.check_pinned("k3", 10 * BLOCK_SIZE)


def test_no_keeper_tier_means_no_server_wide_limit():
    reg = registry()
    run_turn(reg, None, hashes("a", 1000))
    reg.check_pinned(None, 10**6)
