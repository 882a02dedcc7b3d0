"""The expiring-record store sessions and stored responses share: load on start, the sweep, writes
a full disk refuses, and the republish after a shared backend lost data."""

from __future__ import annotations

import errno
from typing import Any

import pytest

from kvhive.sessions.errors import SessionNotDurable
from kvhive.sessions.expiring import ExpiringStore
from kvhive.sessions.session import Session


class DictBackend:
    """Records in a dict; ``full`` makes every save fail as a full disk does."""

    def __init__(self, shared: bool = False) -> None:
        self.shared = shared
        self.records: dict[tuple[str | None, str], dict[str, Any]] = {}
        self.full = False

    def load_all(self) -> list[dict[str, Any]]:
        return [] if self.shared else list(self.records.values())

    def load(self, owner: str | None, record_id: str) -> dict[str, Any] | None:
        return self.records.get((owner, record_id))

    def save(self, record: dict[str, Any]) -> None:
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.records[(record["owner"], record["id"])] = record

    def delete(self, owner: str | None, record_id: str) -> None:
        self.records.pop((owner, record_id), None)


def session(session_id: str, expires: float, in_memory: bool = False) -> Session:
    return Session(session_id, "k", "m", 60, 0.0, expires, in_memory=in_memory)


def store(backend: DictBackend, now: float = 100.0) -> ExpiringStore[Session]:
    return ExpiringStore(backend, Session.from_json, "session", "session records", clock=lambda: now)


def test_a_local_backend_is_held_at_start_and_the_sweep_drops_expired_records_there_too() -> None:
    backend = DictBackend()
    first = store(backend)
    for record in (session("old", 50.0), session("live", 500.0), session("mem", 500.0, in_memory=True)):
        first.save(record)
    assert sorted(backend.records) == [("k", "live"), ("k", "old")]      # in memory only: never written
    again = store(backend)
    assert sorted(s.session_id for s in again) == ["live", "old"]       # expired ones too, for the sweep
    assert [s.session_id for s in again.pop_expired()] == ["old"]
    assert sorted(backend.records) == [("k", "live")]


def test_a_full_disk_refuses_the_write_and_counts_it() -> None:
    backend = DictBackend()
    records = store(backend)
    backend.full = True
    with pytest.raises(SessionNotDurable) as refused:
        records.save(session("s", 500.0))
    assert refused.value.code == "insufficient_storage" and records.write_failures.total == 1


def test_a_lost_shared_backend_gets_every_live_written_record_again() -> None:
    backend = DictBackend(shared=True)
    records = store(backend)
    for held in (session("live", 500.0), session("old", 50.0), session("mem", 500.0, in_memory=True)):
        records.hold(held)
    assert records.republish_if_wanted() == 0                            # nothing lost yet
    records.want_republish()
    read = records.fetch("k", "live", lambda record: record is None)
    assert read.record is not None and read.record["id"] == "live" and not read.lost
    assert sorted(backend.records) == [("k", "live")]
