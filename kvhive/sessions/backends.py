"""Where session records persist: one small JSON record per session, in a disk directory or Redis.

A record is ``Session.to_json()``: id, owner, model, ttl, created, expires, tokens, block hashes.
Both backends write one record per session, so a turn costs one small write whatever the number
of sessions, and replicas sharing a Redis never overwrite each other's sessions.

- ``FileBackend`` (``--disk-cache-dir`` without ``--redis-url``; local to one replica): one file
  per session under ``sessions/``, replaced atomically (temp file, fsync, rename), so a kill
  leaves the old record or the new one, and a failed write (a full disk: OSError) the old one; the
  temp files a kill leaves are removed at start. The registry loads them all at start.
- ``RedisBackend`` (``--redis-url``, with or without a disk dir; shared by replicas): one key per
  session, ``{prefix}:{owner}:{id}`` (``kvhive:{model}:sessions:{owner}:{id}``, named by
  ``kvhive.sessions.durable``), whose Redis expiry is the session's expiry,
  so Redis drops dead sessions itself. ``shared``: another replica may change or delete a record
  at any time, so the registry reads it again on each use and loads sessions on first use, never
  all. Every call goes through the URL's ``RedisGuard`` (``kvhive.store.redis_guard``): on its record
  thread (never the event loop; writes queued, not waited for), behind its circuit breaker
  (``RedisUnavailable`` at once while Redis is unreachable).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from typing import Protocol

from kvhive.core import atomic_file
from kvhive.core.atomic_file import atomic_write
from kvhive.sessions.expiring import RecordBackend

logger = logging.getLogger(__name__)

SESSIONS_DIR = "sessions"


class SessionBackend(RecordBackend, Protocol):
    """One record per session (``Session.to_json()``), keyed by (owner, id)."""


def record_name(owner: str | None, session_id: str) -> str:
    """The session's record name: owner and id, with '-' for no owner (ids are the last part)."""
    return f"{owner or '-'}:{session_id}"


def record_digest(owner: str | None, record_id: str) -> str:
    """A file-name-safe digest of ``record_name`` (ids come from clients, e.g. conversation_id)."""
    return hashlib.sha256(record_name(owner, record_id).encode()).hexdigest()[:40]


def remove_temp_files(directory: str) -> int:
    """Delete the temp files a kill left in ``directory`` (mid ``atomic_write``), logged; how many."""
    removed = atomic_file.remove_temp_files(directory)
    if removed:
        logger.info("removed %d temp files left in %s", removed, directory)
    return removed


class FileBackend:
    """One JSON file per session in ``{directory}/sessions``, each replaced atomically."""

    shared = False

    def __init__(self, directory: str) -> None:
        self.directory = os.path.join(directory, SESSIONS_DIR)
        os.makedirs(self.directory, exist_ok=True)
        remove_temp_files(self.directory)

    def _path(self, owner: str | None, session_id: str) -> str:
        return os.path.join(self.directory, f"{record_digest(owner, session_id)}.json")

    def load_all(self) -> list[dict]:
        """Every record in the directory (a corrupt one is logged and skipped)."""
        records = []
        for name in sorted(os.listdir(self.directory)):
            if not name.endswith(".json"):
                continue
            path = os.path.join(self.directory, name)
            try:
                with open(path, "rb") as f:
                    records.append(json.loads(f.read()))
            except (OSError, ValueError):
                logger.exception("skipping unreadable session record %s", path)
        return records

    def load(self, owner: str | None, session_id: str) -> dict | None:
        """The session's record, or None."""
        try:
            with open(self._path(owner, session_id), "rb") as f:
                return json.loads(f.read())
        except FileNotFoundError:
            return None

    def save(self, record: dict) -> None:
        """Replace the record; a kill at any point leaves the old or the new one."""
        atomic_write(self._path(record["owner"], record["id"]), json.dumps(record).encode())

    def delete(self, owner: str | None, session_id: str) -> None:
        """Remove the record's file."""
        try:
            os.unlink(self._path(owner, session_id))
        except FileNotFoundError:
            pass


class RedisRecords:
    """Records shared by every replica: one Redis key per (owner, id) under ``prefix``, read and
    written through the URL's ``RedisGuard``."""

    shared = True
    noun = "record"                    # what a record is, in the guard's failure lines

    def __init__(self, url: str, prefix: str, timeout_s: float = 2.0) -> None:
        from kvhive.store.redis_guard import guard_for

        self.guard = guard_for(url, timeout_s=timeout_s)
        self.client = self.guard.client
        self.prefix = prefix

    def key(self, owner: str | None, record_id: str) -> str:
        """The record's Redis key."""
        return f"{self.prefix}:{record_name(owner, record_id)}"

    def load_all(self) -> list[dict]:
        """None: records load on first use (each replica holds the ones it serves)."""
        return []

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from any thread) when Redis may lack records held here (``RedisGuard``)."""
        self.guard.add_listener(callback)

    def check_data(self) -> bool:
        """True when Redis lost its data since this process last looked (the guard's listeners
        are told); RedisUnavailable when it cannot tell. Blocking: call it off the event loop."""
        return self.guard.read(self.guard.check_data)

    def delete(self, owner: str | None, record_id: str) -> None:
        """Queue the deletion of the record's key."""
        key = self.key(owner, record_id)
        self.guard.write(lambda: self.client.delete(key), f"the deletion of {self.noun} {record_id}")


class RedisBackend(RedisRecords):
    """One Redis key per session under ``prefix``, expiring when the session does."""

    noun = "session"

    def load(self, owner: str | None, session_id: str) -> dict | None:
        """The session's record, or None (Redis drops a record at its expiry); blocks until read
        (RedisUnavailable while Redis is unreachable)."""
        raw = self.guard.read(lambda: self.client.get(self.key(owner, session_id)))
        return None if raw is None else json.loads(raw)

    def save(self, record: dict) -> None:
        """Queue one SET with the session's expiry (PXAT): atomic, and Redis drops it when the session expires."""
        key = self.key(record["owner"], record["id"])
        value, expires_ms = json.dumps(record), max(1, int(record["expires"] * 1000))
        self.guard.write(lambda: self.client.set(key, value, pxat=expires_ms), f"session {record['id']}")
