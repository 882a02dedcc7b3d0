"""A stopping replica hands its sessions to the shared tier (``KVHiveReplica.__del__``).

Ray Serve stops a replica on scale-down (or a redeploy) gracefully: the controller stops routing
to it, waits for its ongoing requests, then calls its ``__del__``. There, before the engine
closes, ``drain_sessions``:

1. waits for the engine's last requests and for every KV save queued to the store tiers;
2. copies each live session's blocks that the shared tier (Redis) lacks from this replica's own
   tiers (CPU memory, disk) into it: a save the writer skipped while behind, or one Redis refused;
3. writes each live session's record to the session store (Redis) where it is missing there.

The next turn of such a session reaches another replica (``KVAwareRequestRouter`` no longer offers
this one, and its blocks leave the index), which reads the record and loads the blocks from Redis.
Without a shared tier nothing moves: the replica's sessions end with it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvhive.engine.client import EngineClient
    from kvhive.launch.replica import Replica
    from kvhive.sessions.backends import SessionBackend
    from kvhive.sessions.registry import Session

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.05


@dataclass(frozen=True)
class DrainReport:
    """What a drain found and moved."""

    sessions: int = 0             # live sessions this replica knew of
    blocks: int = 0               # their distinct full blocks
    in_shared_tier: int = 0       # of those, in the shared tier once the drain ended
    copied: int = 0               # copied into it from this replica's own tiers by the drain
    records_written: int = 0      # session records the session store lacked
    shared_tier: str | None = None


def wait_idle(client: EngineClient, timeout_s: float) -> bool:
    """Wait (at most ``timeout_s``) until the engine runs and queues no request; whether it did."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = client.stats()
        if stats.num_running == 0 and stats.num_waiting == 0:
            return True
        time.sleep(IDLE_POLL_S)
    return False


def drain_sessions(replica: Replica, idle_timeout_s: float = 5.0) -> DrainReport:
    """Move every live session's KV blocks and record to the shared tier (see the module
    docstring); blocking, so it runs on a worker thread."""
    client = replica.client
    if not wait_idle(client, idle_timeout_s):
        logger.warning("drain: requests still running after %.1fs", idle_timeout_s)
    sessions = [s for s in replica.live_sessions() if not s.in_memory]      # in-memory pins end here
    hashes = sorted({h for session in sessions for h in session.block_hashes})
    copy = client.copy_to_shared_tier([bytes.fromhex(h) for h in hashes])
    if copy is None:
        return DrainReport(sessions=len(sessions))
    return DrainReport(sessions=len(sessions), blocks=copy.blocks, in_shared_tier=copy.in_shared_tier,
                       copied=copy.copied, records_written=_write_missing_records(replica.session_backend, sessions),
                       shared_tier=copy.tier)


def _write_missing_records(backend: SessionBackend | None, sessions: list[Session]) -> int:
    """Write the records of ``sessions`` that ``backend`` (the session store) lacks; how many were written."""
    if backend is None:
        return 0
    written = 0
    for session in sessions:
        try:
            if backend.load(session.owner, session.session_id) is None:
                backend.save(session.to_json())
                written += 1
        except Exception:  # noqa: BLE001 - the store is down: the session cannot move, the rest still may
            logger.exception("drain: could not write session %s", session.session_id)
    return written
