"""DiskStore: segments, restart, budget, corruption and torn writes are misses, SIGKILL mid-write."""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvhive.store import disk as disk_module
from kvhive.store import segment as segment_module
from kvhive.store.disk import DiskStore
from kvhive.store.key import KeySpace
from kvhive.store.segment import SNAPSHOT_NAME, list_segments, scan_segment, segment_path

SPACE = KeySpace("test-model", 1, "float32", 16)
BLOCK = 10_000
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def key(i: int):
    return SPACE.key(i.to_bytes(16, "little"))


def payload(i: int, size: int = BLOCK) -> bytes:
    return (i.to_bytes(4, "little") * (size // 4 + 1))[:size]


def open_store(path, budget=10_000_000, segment=200_000) -> DiskStore:
    return DiskStore(str(path), budget_bytes=budget, segment_bytes=segment)


def fill(store: DiskStore, indices) -> None:
    for i in indices:
        assert store.put(key(i), payload(i))


def check_all(store: DiskStore, indices) -> None:
    for i in indices:
        got = store.get(key(i))
        assert got is not None and bytes(got) == payload(i), i


def test_put_get_contains_delete(tmp_path):
    store = open_store(tmp_path)
    assert store.get(key(1)) is None
    fill(store, [1, 2])
    check_all(store, [1, 2])
    assert store.contains([key(1), key(3)]) == [True, False]
    store.delete(key(1))
    assert store.get(key(1)) is None
    assert store.put(key(9), b"x" * 300_000).stored is False      # larger than a segment
    s = store.stats()
    assert (s.hits, s.bytes_in, s.budget_bytes) == (2, 2 * BLOCK, 10_000_000)
    store.close()


def test_blocks_are_packed_into_few_segment_files(tmp_path):
    store = open_store(tmp_path)
    fill(store, range(100))
    segments = list_segments(str(tmp_path))
    assert len(segments) == 6                              # 100 records of ~10 KB in 200 KB segments
    assert all(os.path.getsize(segment_path(str(tmp_path), s)) <= 200_000 for s in segments)
    assert store.stats().used_bytes == sum(os.path.getsize(segment_path(str(tmp_path), s)) for s in segments)
    store.close()


@pytest.mark.parametrize("clean_close", [True, False])
def test_survives_reopen(tmp_path, clean_close, monkeypatch):
    store = open_store(tmp_path)
    fill(store, range(50))
    if clean_close:
        store.close()
        assert os.path.exists(tmp_path / SNAPSHOT_NAME)
        monkeypatch.setattr(segment_module, "scan_segment", None)   # the snapshot alone must do
    # Without close the index comes from scanning segment headers (the process "died").
    reopened = open_store(tmp_path)
    monkeypatch.undo()
    assert not os.path.exists(tmp_path / SNAPSHOT_NAME)    # a snapshot is used once
    assert reopened.contains([key(i) for i in range(51)]) == [True] * 50 + [False]
    check_all(reopened, range(50))
    fill(reopened, range(50, 60))
    reopened.close()
    again = open_store(tmp_path)
    check_all(again, range(60))
    again.close()


def test_damaged_snapshot_falls_back_to_scan(tmp_path):
    store = open_store(tmp_path)
    fill(store, range(30))
    store.close()
    raw = bytearray((tmp_path / SNAPSHOT_NAME).read_bytes())
    raw[20] ^= 0xFF
    (tmp_path / SNAPSHOT_NAME).write_bytes(bytes(raw))
    reopened = open_store(tmp_path)
    check_all(reopened, range(30))
    reopened.close()


def test_budget_evicts_oldest_segments_and_keeps_hot_blocks(tmp_path):
    store = open_store(tmp_path, budget=1_000_000, segment=100_000)
    fill(store, range(10))
    for i in range(10, 400):
        assert store.put(key(i), payload(i))
        check_all(store, [0])                              # block 0 is read all along: moved forward
    stats = store.stats()
    assert stats.used_bytes <= 1_000_000
    assert stats.evictions > 250
    assert store.contains([key(1), key(2), key(0), key(399)]) == [False, False, True, True]
    check_all(store, [0, 398, 399])
    assert len(list_segments(str(tmp_path))) <= 12          # ~9 records of 10 KB per 100 KB segment
    store.close()
    reopened = open_store(tmp_path, budget=1_000_000, segment=100_000)
    check_all(reopened, [0, 399])
    reopened.close()


def test_reads_below_half_the_budget_rewrite_nothing(tmp_path):
    store = open_store(tmp_path, budget=10_000_000, segment=100_000)
    fill(store, range(100))
    used = store.stats().used_bytes
    for _ in range(3):
        check_all(store, range(100))
        fill(store, range(100))                            # put again: already stored, no write
    assert store.stats().used_bytes == used
    store.close()


def test_smaller_budget_on_reopen_drops_oldest(tmp_path):
    store = open_store(tmp_path, budget=2_000_000, segment=100_000)
    fill(store, range(150))
    store.close()
    reopened = open_store(tmp_path, budget=500_000, segment=100_000)
    assert reopened.stats().used_bytes <= 500_000
    assert reopened.contains([key(0), key(149)]) == [False, True]
    reopened.close()


def _record_offset(store: DiskStore, i: int):
    loc = store._index.get(key(i).encode())
    return segment_path(store.directory, loc.segment), loc.offset, loc.length


@pytest.mark.parametrize("where", ["payload", "header"])
def test_corrupt_byte_is_a_miss_and_others_still_load(tmp_path, where):
    store = open_store(tmp_path)
    fill(store, range(40))
    path, offset, length = _record_offset(store, 5)
    pos = offset + (length - 7 if where == "payload" else 30)
    with open(path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0x01]))
    assert store.get(key(5)) is None
    assert store.stats().errors == 1
    check_all(store, [i for i in range(40) if i != 5])
    del store                                              # no close: the reopen scans segments
    reopened = open_store(tmp_path)
    assert reopened.get(key(5)) is None
    check_all(reopened, [i for i in range(40) if i != 5])
    reopened.close()


def test_torn_tail_is_truncated_on_reopen(tmp_path):
    store = open_store(tmp_path)
    fill(store, range(25))
    path, offset, length = _record_offset(store, 24)       # the last record of the active segment
    assert os.path.getsize(path) == offset + length
    del store
    os.truncate(path, offset + length // 2)
    reopened = open_store(tmp_path)
    assert os.path.getsize(path) == offset                 # the torn record is cut off
    assert reopened.get(key(24)) is None
    check_all(reopened, range(24))
    fill(reopened, [24, 25])                               # appends continue cleanly after the cut
    reopened.close()
    check_all(open_store(tmp_path), range(26))


def test_failed_write_is_cut_off_and_later_writes_work(tmp_path, monkeypatch):
    store = open_store(tmp_path)
    fill(store, range(3))
    real_append = disk_module.append_record

    def io_error(fd, buffers):
        os.write(fd, bytes(buffers[0])[:10])               # a partial record, then an I/O error
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(disk_module, "append_record", io_error)
    assert not store.put(key(3), payload(3))
    assert store.stats().write_errors == 1 and store.get(key(3)) is None
    assert store.stats().evictions == 0                    # only a full filesystem drops segments
    monkeypatch.setattr(disk_module, "append_record", real_append)
    fill(store, [4, 5])
    check_all(store, [0, 1, 2, 4, 5])
    del store
    reopened = open_store(tmp_path)                        # the scan agrees: no garbage in between
    check_all(reopened, [0, 1, 2, 4, 5])
    assert reopened.get(key(3)) is None
    reopened.close()


WRITER = textwrap.dedent("""
    import sys
    from kvhive.store.disk import DiskStore
    from kvhive.store.key import KeySpace
    space = KeySpace("test-model", 1, "float32", 16)
    store = DiskStore(sys.argv[1], budget_bytes=1 << 30, segment_bytes=8 << 20)
    start, size = int(sys.argv[2]), int(sys.argv[3])
    for i in range(start, start + 100_000):
        data = (i.to_bytes(4, "little") * (size // 4 + 1))[:size]
        assert store.put(space.key(i.to_bytes(16, "little")), data)
        print(i, flush=True)
""")


@pytest.mark.timeout(60)
def test_sigkill_mid_write_leaves_only_intact_objects(tmp_path):
    # 4 MB records: the writer spends enough time inside writev that a kill often tears a record
    # (the kernel stops a write to a regular file part way on SIGKILL).
    size = 4_000_000
    env = {**os.environ, "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    rng = random.Random(0)
    confirmed: list[int] = []
    start = 0
    for _ in range(5):                                     # five kills on the same directory
        child = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(start), str(size)],
                                 stdout=subprocess.PIPE, env=env, text=True)
        for _ in range(3):
            confirmed.append(int(child.stdout.readline()))
        time.sleep(rng.uniform(0, 0.005))
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        child.stdout.close()
        store = DiskStore(str(tmp_path), budget_bytes=1 << 30, segment_bytes=8 << 20)
        last = segment_path(str(tmp_path), list_segments(str(tmp_path))[-1])
        assert scan_segment(last).good_end == os.path.getsize(last)   # no torn bytes left behind
        for i in confirmed:                                # every put that returned is there
            got = store.get(key(i))
            assert got is not None and bytes(got) == payload(i, size), i
        for i in range(start, start + 10):                 # anything else found is intact
            got = store.get(key(i))
            assert got is None or bytes(got) == payload(i, size), i
        assert store.stats().errors == 0
        start = confirmed[-1] + 10
        del store


@pytest.mark.timeout(60)
def test_concurrent_puts_gets_and_evictions_never_return_wrong_bytes(tmp_path):
    store = open_store(tmp_path, budget=600_000, segment=100_000)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(400):
            i = rng.randrange(120)
            if rng.random() < 0.5:
                store.put(key(i), payload(i))
            else:
                got = store.get(key(i))
                assert got is None or bytes(got) == payload(i)

    with ThreadPoolExecutor(4) as pool:
        for future in [pool.submit(worker, seed) for seed in range(4)]:
            future.result()                                # re-raises a worker's failed assertion
    stats = store.stats()
    assert stats.errors == 0 and stats.used_bytes <= 600_000 and stats.evictions > 0
    segments = list_segments(str(tmp_path))
    assert stats.used_bytes == sum(os.path.getsize(segment_path(str(tmp_path), s)) for s in segments)
    store.close()
