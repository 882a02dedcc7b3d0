"""A full filesystem (a small tmpfs): the disk tier drops its oldest unpinned segments to make room,
then refuses cleanly; session and response records are refused (SessionNotDurable) with the old
record intact; no temp file stays; failures are logged once per interval with a count."""

from __future__ import annotations

import asyncio
import json
import logging
import os

import pytest
from support.sessions import BLOCK_BYTES, BLOCK_SIZE, CONFIG, Holder
from support.tmpfs import SmallTmpfs, small_tmpfs

from kvhive.core.failure_log import FailureLog
from kvhive.sessions.backends import FileBackend
from kvhive.sessions.errors import SessionNotDurable, SessionNotFound
from kvhive.sessions.expiring import ExpiringStore
from kvhive.sessions.response_backends import FileResponseBackend
from kvhive.sessions.response_store import ResponseStore, StoredResponse, new_conversation_id, new_response_id
from kvhive.sessions.service import SessionService
from kvhive.sessions.session import Session
from kvhive.store.disk import DiskStore
from kvhive.store.key import KeySpace

SPACE = KeySpace("test-model", 1, "float32", 16)
BLOCK = 10_000
FS_BYTES = 2 << 20


def key(i: int):
    return SPACE.key(i.to_bytes(16, "little"))


def payload(i: int) -> bytes:
    return (i.to_bytes(4, "little") * (BLOCK // 4 + 1))[:BLOCK]


def temp_files(root: str) -> list[str]:
    return [os.path.join(d, n) for d, _, names in os.walk(root) for n in names if n.endswith(".tmp")]


def readable(store: DiskStore, indices) -> list[int]:
    """The indices whose block reads back; a wrong payload fails the test."""
    found = []
    for i in indices:
        got = store.get(key(i))
        if got is not None:
            assert bytes(got) == payload(i), i
            found.append(i)
    return found


@pytest.fixture
def tmpfs(tmp_path):
    with small_tmpfs(str(tmp_path / "fs"), FS_BYTES) as mounted:
        yield mounted


def open_store(fs: SmallTmpfs) -> DiskStore:
    # A budget far above the filesystem: only ENOSPC bounds the tier.
    return DiskStore(os.path.join(fs.path, "kv"), budget_bytes=1 << 30, segment_bytes=100_000,
                     failure_log_interval_s=3600)


def test_full_filesystem_drops_oldest_unpinned_segments_and_keeps_working(tmpfs, caplog):
    store = open_store(tmpfs)
    pinned = range(5)
    for i in pinned:
        assert store.put(key(i), payload(i))
    store.pin([key(i) for i in pinned])
    n = 2 * FS_BYTES // BLOCK                     # twice what the filesystem holds
    for i in range(5, n):
        assert store.put(key(i), payload(i)), i  # each put makes room for itself
    stats = store.stats()
    assert stats.evictions > 0 and stats.write_errors == 0
    assert readable(store, pinned) == list(pinned)          # pinned blocks stayed
    recent = readable(store, range(n - 20, n))
    assert recent == list(range(n - 20, n))
    assert readable(store, range(20, 60)) == []             # the oldest unpinned segments went
    assert temp_files(tmpfs.path) == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    store.close()


def test_nothing_to_drop_refuses_cleanly_and_a_torn_write_is_a_miss(tmpfs, caplog):
    store = open_store(tmpfs)
    kept = range(20)
    for i in kept:
        assert store.put(key(i), payload(i))
    store.pin([key(i) for i in kept])
    filler = tmpfs.fill(leave_bytes=BLOCK // 2)   # room for half a block: every write tears
    caplog.set_level(logging.WARNING, logger="kvhive.store.disk")
    refused = range(100, 160)
    for i in refused:
        assert not store.put(key(i), payload(i))
    assert store.stats().write_errors == len(refused)
    assert readable(store, refused) == []
    assert readable(store, kept) == list(kept)               # pinned blocks untouched
    lines = [r.getMessage() for r in caplog.records if r.name == "kvhive.store.disk"]
    assert len(lines) == 1 and "writes failed: 1" in lines[0] and "No space left" in lines[0], lines
    assert temp_files(tmpfs.path) == []

    os.unlink(filler)                              # room again: writes work
    assert store.put(key(200), payload(200)) and readable(store, [200]) == [200]
    store.close()
    reopened = open_store(tmpfs)                   # nothing torn decodes: each block reads right or misses
    assert readable(reopened, [*kept, 200]) == [*kept, 200]
    assert readable(reopened, refused) == []
    reopened.close()


def test_close_on_a_full_filesystem_leaves_no_temp_file_and_the_next_start_scans(tmpfs):
    store = open_store(tmpfs)
    for i in range(10):
        assert store.put(key(i), payload(i))
    filler = tmpfs.fill()
    store.close()                                  # the snapshot cannot be written: no exception
    assert temp_files(tmpfs.path) == []
    os.unlink(filler)
    reopened = open_store(tmpfs)
    assert readable(reopened, range(10)) == list(range(10))
    reopened.close()


def test_start_removes_temp_files_a_crash_left(tmp_path):
    kv, sessions = tmp_path / "kv", tmp_path / "sessions"
    kv.mkdir()
    sessions.mkdir()
    conversation = tmp_path / "responses" / "abc"
    conversation.mkdir(parents=True)
    for path in (kv / "index.snapshot.tmp", sessions / "x.json.tmp", conversation / "resp_1.json.tmp"):
        path.write_bytes(b"{half a rec")
    DiskStore(str(kv), budget_bytes=1 << 20).close()
    FileBackend(str(tmp_path))
    FileResponseBackend(str(tmp_path))
    assert temp_files(str(tmp_path)) == []


def session(i: int, tokens: int = 0) -> Session:
    return Session(f"sess-{i}", "owner", "m", 600, 1000.0, 1600.0, tokens, [f"{tokens:064x}"])


def on_disk(path: str) -> ExpiringStore[Session]:
    """The session records in ``path``, as a restarted registry loads them."""
    return ExpiringStore(FileBackend(path), Session.from_json, "session", "session records")


def test_session_record_on_a_full_disk_is_refused_and_the_old_one_stays(tmpfs):
    records = on_disk(tmpfs.path)
    records.save(session(1, tokens=10))
    filler = tmpfs.fill()
    with pytest.raises(SessionNotDurable) as refused:
        records.save(session(1, tokens=99))        # a turn of an old session
    assert refused.value.code == "insufficient_storage"
    with pytest.raises(SessionNotDurable):
        records.save(session(2))                   # a new session
    assert temp_files(tmpfs.path) == []
    assert [(s.session_id, s.num_tokens) for s in on_disk(tmpfs.path)] == [("sess-1", 10)]
    os.unlink(filler)
    records.save(session(2))
    assert sorted(s.session_id for s in on_disk(tmpfs.path)) == ["sess-1", "sess-2"]


def test_a_session_turn_whose_record_cannot_be_written_raises_and_keeps_the_old_record(tmpfs):
    holder = Holder()
    sessions = SessionService(CONFIG, holder, block_bytes=BLOCK_BYTES, block_size=BLOCK_SIZE,
                              backend=FileBackend(tmpfs.path))
    old = asyncio.run(sessions.open_turn("k", "m", 64, new_ttl=600))
    old.end(40, [bytes(16)] * 2)
    created = asyncio.run(sessions.open_turn("k", "m", 64, new_ttl=600))   # its record is written
    turn = asyncio.run(sessions.open_turn("k", "m", 64, session_id=old.session.session_id))
    filler = tmpfs.fill()
    with pytest.raises(SessionNotDurable):
        created.end(20, [bytes(16)])         # a new session whose first turn cannot be recorded: ended
    assert created.session.engine_id in holder.released
    refill = tmpfs.fill("refill")            # its deleted record freed a page
    with pytest.raises(SessionNotDurable):
        turn.end(60, [bytes(16)] * 3)        # an old session keeps what it holds here
    assert [s.session_id for s in sessions.list("k")] == [old.session.session_id]
    assert holder.held[-1] == (old.session.engine_id, [bytes(16)] * 3)
    with pytest.raises(SessionNotDurable):
        sessions.set_ttl(old.session, 60)    # a new TTL is refused and not applied
    assert old.session.ttl_s == 600
    aborted = asyncio.run(sessions.open_turn("k", "m", 64, session_id=old.session.session_id))
    aborted.end()                            # a turn nobody waits for: no error, the old record stays
    assert temp_files(tmpfs.path) == []
    os.unlink(filler)
    os.unlink(refill)
    assert [(s.session_id, s.num_tokens) for s in on_disk(tmpfs.path)] == [(old.session.session_id, 40)]


def stored(conversation_id: str, text: str) -> StoredResponse:
    response = {"id": new_response_id(conversation_id), "object": "response", "output": [{"text": text}],
                "previous_response_id": None}
    return StoredResponse("owner", response, [{"role": "user", "content": text}])


def test_stored_response_on_a_full_disk_is_refused_and_nothing_changes(tmpfs):
    store = ResponseStore(FileResponseBackend(tmpfs.path), clock=lambda: 1000.0)
    conversation_id = new_conversation_id()
    first = stored(conversation_id, "kept")
    store.add(first, 2000.0)
    filler = tmpfs.fill()
    second = stored(conversation_id, "x" * 4000)
    with pytest.raises(SessionNotDurable):
        store.add(second, 3000.0)
    with pytest.raises(SessionNotDurable):
        store.add(stored(new_conversation_id(), "new"), 3000.0)
    assert temp_files(tmpfs.path) == []
    os.unlink(filler)
    reloaded = ResponseStore(FileResponseBackend(tmpfs.path), clock=lambda: 1000.0)
    assert reloaded.get(first.response_id, "owner").response == first.response
    for held in (store, reloaded):               # neither here nor on disk
        with pytest.raises(SessionNotFound):
            held.get(second.response_id, "owner")
    record = json.loads(open(os.path.join(tmpfs.path, "responses", os.listdir(
        os.path.join(tmpfs.path, "responses"))[0], "conversation.json")).read())
    assert record["expires"] == 2000.0
    assert len(os.listdir(os.path.join(tmpfs.path, "responses"))) == 1   # no empty directory left


def test_failure_log_writes_one_line_per_interval_with_the_count(caplog):
    now = [0.0]
    log = FailureLog(logging.getLogger("test.failures"), "writes failed", interval_s=10, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger="test.failures")
    for t in (0, 1, 2, 3, 9.9, 10, 11, 25):
        now[0] = t
        log.record(OSError(28, "No space left on device"))
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "writes failed: 1 (last error: [Errno 28] No space left on device)",
        "writes failed: 5 in the last 10 s (last error: [Errno 28] No space left on device)",
        "writes failed: 2 in the last 15 s (last error: [Errno 28] No space left on device)",
    ]
    assert log.total == 8
