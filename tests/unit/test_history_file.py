"""The "history" drafter's store written to the disk cache dir and read back: the same sequences,
tenants and eviction order; a file that is corrupt, cut short, of another model or unwritable is
logged and never read as history."""

from __future__ import annotations

import json
import logging
import random
import struct
import zlib

import pytest

from kvhive.engine.speculative import history_file
from kvhive.engine.speculative.history_file import HistoryFileError, decode, encode
from kvhive.engine.speculative.tenant_history import HistoryStore

MODEL, VOCAB = "model-fingerprint", 500


def _store(seed: int = 0, max_tokens: int = 400, tenant_max: int = 200) -> HistoryStore:
    rng = random.Random(seed)
    store = HistoryStore(2, 4, max_tokens, tenant_max)
    for _ in range(30):
        motif = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 6))]
        store.record(rng.choice(["key:a", None, "key:b:salt"]), (motif * 5)[:rng.randint(3, 40)])
    return store


def test_the_store_comes_back_with_its_order_tenants_and_drafts(tmp_path) -> None:
    before = _store()
    history_file.save(before, str(tmp_path), MODEL, VOCAB)
    after = HistoryStore(2, 4, 400, 200)
    assert history_file.load(after, str(tmp_path), MODEL, VOCAB) == before.num_tokens > 0
    assert list(after.sequences()) == list(before.sequences())
    assert after.stats() == before.stats()
    rng = random.Random(1)
    for tenant in ("key:a", None, "key:b:salt", "key:c"):
        for tokens in (t for t_, t in before.sequences() if t_ == tenant):
            for end in range(2, len(tokens)):
                assert after.propose(tenant, tokens[:end], 5) == before.propose(tenant, tokens[:end], 5)
    new = [rng.randrange(VOCAB) for _ in range(150)]       # the caps evict the same sequences in both
    before.record("key:a", new)
    after.record("key:a", new)
    assert list(after.sequences()) == list(before.sequences())


def test_smaller_caps_keep_the_newest_sequences(tmp_path) -> None:
    before = _store()
    history_file.save(before, str(tmp_path), MODEL, VOCAB)
    small = HistoryStore(2, 4, 100, 60)
    history_file.load(small, str(tmp_path), MODEL, VOCAB)
    kept = list(small.sequences())
    assert small.num_tokens <= 100 and kept == [s for s in before.sequences() if s in kept]
    assert kept[-1] == list(before.sequences())[-1]


def test_no_file_is_an_empty_store(tmp_path) -> None:
    store = HistoryStore(2, 4, 100, 100)
    assert history_file.load(store, str(tmp_path), MODEL, VOCAB) == 0 and store.num_tokens == 0


def _damaged(data: bytes, what: str) -> bytes:
    if what == "flipped byte":
        return data[:-9] + bytes([data[-9] ^ 0x40]) + data[-8:]
    if what == "cut short":
        return data[:len(data) // 2]
    if what == "not a history file":
        return b"PK\x03\x04" + data[4:]
    return b""


@pytest.mark.parametrize(("what", "why"), [("flipped byte", "checksum mismatch"), ("cut short", "checksum mismatch"),
                                          ("not a history file", "not a history file"), ("empty", "not a history file")])
def test_a_damaged_file_is_logged_and_not_read(tmp_path, caplog, what: str, why: str) -> None:
    history_file.save(_store(), str(tmp_path), MODEL, VOCAB)
    path = tmp_path / history_file.FILE_NAME
    path.write_bytes(_damaged(path.read_bytes(), what))
    store = HistoryStore(2, 4, 400, 200)
    with caplog.at_level(logging.WARNING, logger="kvhive.engine.speculative.history_file"):
        assert history_file.load(store, str(tmp_path), MODEL, VOCAB) == 0
    assert store.num_tokens == 0 and any(why in r.getMessage() for r in caplog.records)


def _file(header: dict | bytes, tokens: list[int]) -> bytes:
    """A history file of this header (or header text) and these tokens, laid out and checksummed as
    ``encode`` does."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    body = history_file.MAGIC + struct.pack("<I", len(text)) + text + struct.pack(f"<{len(tokens)}i", *tokens)
    return body + struct.pack("<I", zlib.crc32(body))


def test_another_model_or_vocabulary_or_version_is_not_read() -> None:
    data = encode([("t", [1, 2, 3])], MODEL, VOCAB)
    assert decode(data, MODEL, VOCAB) == [("t", [1, 2, 3])]
    for fingerprint, vocab in (("other-model", VOCAB), (MODEL, VOCAB + 1)):
        with pytest.raises(HistoryFileError, match="another model"):
            decode(data, fingerprint, vocab)
    with pytest.raises(HistoryFileError, match="outside the vocabulary"):
        decode(encode([("t", [1, 2, 3])], MODEL, 3), MODEL, 3)
    good = {"version": 1, "model": MODEL, "vocab_size": VOCAB, "tenants": ["t"], "sequences": [[0, 1]]}
    assert decode(_file(good, [1]), MODEL, VOCAB) == [("t", [1])]
    for change, why in (({"version": 9}, "version 9"), ({"sequences": 7}, "bad sequence list"),
                        ({"sequences": [[3, 1]]}, "bad sequence entry"),
                        ({"sequences": [[0, 2]]}, "do not add up"), ({"tenants": [5]}, "bad tenant list")):
        with pytest.raises(HistoryFileError, match=why):           # each file's checksum right
            decode(_file({**good, **change}, [1]), MODEL, VOCAB)
    for text in (b"[" * 200_000 + b"]" * 200_000, b"[1, 2]", b"\xff\xfe", b'{"version": 1'):
        with pytest.raises(HistoryFileError, match="unreadable header"):
            decode(_file(text, [1]), MODEL, VOCAB)


def test_a_write_that_fails_keeps_the_old_file_and_logs(tmp_path, caplog, monkeypatch) -> None:
    history_file.save(_store(), str(tmp_path), MODEL, VOCAB)
    old = (tmp_path / history_file.FILE_NAME).read_bytes()

    def full_disk(path: str, data: bytes) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(history_file, "atomic_write", full_disk)
    with caplog.at_level(logging.WARNING, logger="kvhive.engine.speculative.history_file"):
        history_file.save(_store(seed=3), str(tmp_path), MODEL, VOCAB)
    assert (tmp_path / history_file.FILE_NAME).read_bytes() == old
    assert any("No space left" in r.getMessage() for r in caplog.records)


def test_a_snapshot_keeps_what_the_store_held_while_the_store_goes_on() -> None:
    store = _store(max_tokens=120, tenant_max=80)
    snapshot, held = store.snapshot(), list(store.sequences())
    rng = random.Random(5)
    for _ in range(20):                     # evicts and compacts every tenant's array
        store.record(rng.choice(["key:a", None]), [rng.randrange(VOCAB) for _ in range(30)])
    assert list(snapshot.sequences()) == held != list(store.sequences())


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _file_sequences(directory) -> list:
    return decode((directory / history_file.FILE_NAME).read_bytes(), MODEL, VOCAB)


def test_the_keeper_writes_new_history_once_its_interval_passed(tmp_path) -> None:
    store, clock = HistoryStore(2, 4, 400, 200), _Clock()
    keeper = history_file.HistoryKeeper(store, str(tmp_path), MODEL, VOCAB, interval_s=10, clock=clock)
    clock.now = 60
    assert not keeper.tick()                               # nothing kept: nothing to write
    store.record("key:a", [1, 2, 3, 4, 5])
    assert keeper.tick()
    keeper.wait()
    assert _file_sequences(tmp_path) == [("key:a", [1, 2, 3, 4, 5])]
    store.record(None, [6, 7, 8, 9])
    clock.now = 65
    assert not keeper.tick()                               # too soon after the last write
    clock.now = 70
    assert keeper.tick()
    keeper.wait()
    assert _file_sequences(tmp_path) == list(store.sequences())
    clock.now = 100
    assert not keeper.tick()                               # nothing new since


def test_the_keeper_writes_at_close_what_no_tick_wrote(tmp_path) -> None:
    store = _store()
    keeper = history_file.HistoryKeeper(store, str(tmp_path), MODEL, VOCAB, interval_s=3600)
    store.record("key:a", [10, 11, 12, 13])
    assert not keeper.tick()
    keeper.close()
    assert _file_sequences(tmp_path) == list(store.sequences())
    reloaded = HistoryStore(2, 4, 400, 200)
    history_file.load(reloaded, str(tmp_path), MODEL, VOCAB)
    (tmp_path / history_file.FILE_NAME).unlink()
    history_file.HistoryKeeper(reloaded, str(tmp_path), MODEL, VOCAB).close()
    assert not (tmp_path / history_file.FILE_NAME).exists()     # what was loaded is not written again


def test_a_disk_that_stays_full_warns_once_and_the_next_write_that_works_says_so(tmp_path, caplog,
                                                                                 monkeypatch) -> None:
    store, clock = HistoryStore(2, 4, 400, 200), _Clock()
    keeper = history_file.HistoryKeeper(store, str(tmp_path), MODEL, VOCAB, interval_s=10, clock=clock)
    full = {"on": True}
    real_write = history_file.atomic_write

    def maybe_full(path: str, data: bytes) -> None:
        if full["on"]:
            raise OSError(28, "No space left on device")
        real_write(path, data)

    monkeypatch.setattr(history_file, "atomic_write", maybe_full)
    with caplog.at_level(logging.INFO, logger="kvhive.engine.speculative.history_file"):
        for step in range(3):
            store.record("key:a", [step, 1, 2, 3, 4])
            clock.now += 10
            assert keeper.tick()
            keeper.wait()
        full["on"] = False
        store.record("key:a", [9, 8, 7, 6])
        clock.now += 10
        assert keeper.tick()
        keeper.wait()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "No space left" in warnings[0].getMessage()
    assert any("kept in" in r.getMessage() and "again" in r.getMessage() for r in caplog.records)
    assert _file_sequences(tmp_path) == list(store.sequences())
