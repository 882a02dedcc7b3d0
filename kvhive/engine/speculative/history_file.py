"""The "history" drafter's store kept across a restart: one file in the disk cache dir.

With ``--disk-cache-dir`` the engine writes its ``HistoryStore`` there while it runs (every
``SAVE_INTERVAL_S`` at most, when it kept new sequences: ``HistoryKeeper``) and when it closes (a
graceful stop), and reads it back when it starts, so a restarted server, even one that was killed,
drafts from the requests it answered before, as it keeps their KV and sessions. The file holds
the sequences in the order they were kept (the oldest first, across tenants, so the caps evict the
same ones after a restart), each with its tenant; the n-gram index is rebuilt from them.

Layout: ``MAGIC``, a little-endian uint32 header length, the header (UTF-8 JSON: the format
version, the model's fingerprint, the vocabulary size, the tenants, and per sequence its tenant's
index and length), the tokens of every sequence as little-endian int32, and a CRC-32 of all that
came before. A file that is short, corrupt (checksum), of another version or written for another
model (fingerprint, vocabulary) or whose tokens fall outside the vocabulary is not read: the
engine logs why and starts with an empty store, as without the file. Writing goes through a temp
file and a rename (``kvhive.core.atomic_file``), so a kill leaves the old file or the new one.
Torch-free.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import sys
import threading
import time
import zlib
from array import array
from collections.abc import Callable, Iterable, Sequence

from kvhive.core.atomic_file import atomic_write
from kvhive.engine.speculative.tenant_history import HistorySnapshot, HistoryStore

logger = logging.getLogger(__name__)

FILE_NAME = "speculative-history.bin"
MAGIC = b"KVHHIST\x00"
VERSION = 1
_HEADER_LEN = struct.Struct("<I")
_CRC = struct.Struct("<I")
# The running server writes its history at most this often (when it kept something new), besides
# at a graceful stop: a kill loses at most the last SAVE_INTERVAL_S of history.
SAVE_INTERVAL_S = 10.0


class HistoryFileError(ValueError):
    """Why a history file cannot be read."""


def encode(sequences: Iterable[tuple[str | None, Sequence[int]]], fingerprint: str, vocab_size: int) -> bytes:
    """The file's bytes for ``sequences`` ((tenant, tokens), oldest first)."""
    tenants: dict[str | None, int] = {}
    entries, tokens = [], array("i")
    for tenant, token_ids in sequences:
        entries.append([tenants.setdefault(tenant, len(tenants)), len(token_ids)])
        tokens.extend(token_ids)
    if tokens.itemsize != 4:
        raise RuntimeError("array('i') is not 32-bit on this platform")
    header = json.dumps({"version": VERSION, "model": fingerprint, "vocab_size": vocab_size,
                         "tenants": list(tenants), "sequences": entries}, separators=(",", ":")).encode()
    if sys.byteorder != "little":
        tokens.byteswap()
    body = MAGIC + _HEADER_LEN.pack(len(header)) + header + tokens.tobytes()
    return body + _CRC.pack(zlib.crc32(body))


def decode(data: bytes, fingerprint: str, vocab_size: int) -> list[tuple[str | None, list[int]]]:
    """The sequences ((tenant, tokens), oldest first) of a file's bytes; HistoryFileError saying why
    it cannot be read for this model."""
    if len(data) < len(MAGIC) + _HEADER_LEN.size + _CRC.size or not data.startswith(MAGIC):
        raise HistoryFileError("not a history file")
    body, (crc,) = data[:-_CRC.size], _CRC.unpack(data[-_CRC.size:])
    if zlib.crc32(body) != crc:
        raise HistoryFileError("checksum mismatch")
    (header_len,) = _HEADER_LEN.unpack_from(body, len(MAGIC))
    start = len(MAGIC) + _HEADER_LEN.size
    try:
        header = json.loads(body[start:start + header_len])
        version, model, vocab = header["version"], header["model"], header["vocab_size"]
        tenants, entries = header["tenants"], header["sequences"]
    except (ValueError, KeyError, TypeError, RecursionError) as exc:     # RecursionError: deep nesting
        raise HistoryFileError(f"unreadable header: {type(exc).__name__}") from exc
    if version != VERSION:
        raise HistoryFileError(f"format version {version!r}, not {VERSION}")
    if model != fingerprint or vocab != vocab_size:
        raise HistoryFileError("written for another model")
    payload = body[start + header_len:]
    if len(payload) % 4:
        raise HistoryFileError("token data cut short")
    tokens = array("i")
    tokens.frombytes(payload)
    if sys.byteorder != "little":
        tokens.byteswap()
    if not isinstance(tenants, list) or not all(t is None or isinstance(t, str) for t in tenants):
        raise HistoryFileError("bad tenant list")
    if not isinstance(entries, list):
        raise HistoryFileError("bad sequence list")
    out, offset = [], 0
    for entry in entries:
        if (not isinstance(entry, list) or len(entry) != 2 or not all(isinstance(v, int) for v in entry)
                or not 0 <= entry[0] < len(tenants) or entry[1] < 0):
            raise HistoryFileError("bad sequence entry")
        out.append((tenants[entry[0]], tokens[offset:offset + entry[1]].tolist()))
        offset += entry[1]
    if offset != len(tokens):
        raise HistoryFileError("sequence lengths do not add up to the token data")
    if tokens and not (0 <= min(tokens) and max(tokens) < vocab_size):
        raise HistoryFileError("a token outside the vocabulary")
    return out


def save(store: HistoryStore | HistorySnapshot, directory: str, fingerprint: str, vocab_size: int,
         warn: bool = True) -> bool:
    """Write ``store`` (or a snapshot of one) to ``directory``'s history file; a write that fails
    (a full disk) is logged (a warning unless ``warn`` is false), leaves the previous file as it
    was and returns False."""
    path = os.path.join(directory, FILE_NAME)
    try:
        os.makedirs(directory, exist_ok=True)
        atomic_write(path, encode(store.sequences(), fingerprint, vocab_size))
    except OSError as exc:
        logger.log(logging.WARNING if warn else logging.DEBUG, "could not keep the speculative history in %s: %s",
                   path, exc)
        return False
    return True


class HistoryKeeper:
    """Keeps ``directory``'s history file current while the engine runs, so a server that is killed
    (not stopped) restarts with the history of its last seconds, not of its last graceful stop.

    ``tick`` runs on the engine's loop thread after each step and while it idles: once at least
    ``interval_s`` passed since the last write and the store kept new sequences, it takes a snapshot
    (one array copy per tenant: milliseconds for a million tokens) and encodes and writes it on a
    helper thread, one write at a time; the engine never waits on the disk. ``close`` waits for that
    write and writes the store as it is at the stop.
    """

    def __init__(self, store: HistoryStore, directory: str, fingerprint: str, vocab_size: int,
                 interval_s: float = SAVE_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.directory = store, directory
        self.fingerprint, self.vocab_size = fingerprint, vocab_size
        self.interval_s, self._clock = interval_s, clock
        self._saved_changes = store.changes           # what the file holds already (what was loaded)
        self._last_write = clock()
        self._writer: threading.Thread | None = None
        self._failing = False                         # the last write failed (and said so)

    def tick(self) -> bool:
        """Start a write of the store if it is due; whether one started."""
        if self.store.changes == self._saved_changes or self._clock() - self._last_write < self.interval_s:
            return False
        if self._writer is not None and self._writer.is_alive():
            return False
        snapshot, self._saved_changes, self._last_write = self.store.snapshot(), self.store.changes, self._clock()
        self._writer = threading.Thread(target=self._write, args=(snapshot,), name="kvhive-history-save",
                                        daemon=True)
        self._writer.start()
        return True

    def wait(self) -> None:
        """Wait for the write under way, if any."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None

    def close(self) -> None:
        """Finish the write under way and write the store as it is now (if it kept anything new)."""
        self.wait()
        if self.store.changes != self._saved_changes:
            self._saved_changes = self.store.changes
            if save(self.store, self.directory, self.fingerprint, self.vocab_size):
                logger.info("kept the speculative history in %s (%d tokens)",
                            os.path.join(self.directory, FILE_NAME), self.store.num_tokens)

    def _write(self, snapshot: HistorySnapshot) -> None:
        # A disk that stays full warns once, not at every write; the first write that works says so.
        saved = save(snapshot, self.directory, self.fingerprint, self.vocab_size, warn=not self._failing)
        if saved and self._failing:
            logger.info("the speculative history is kept in %s again", self.directory)
        self._failing = not saved


def load(store: HistoryStore, directory: str, fingerprint: str, vocab_size: int) -> int:
    """Refill ``store`` from ``directory``'s history file, oldest sequence first (its caps apply);
    the tokens read (0 where there is no file or it cannot be read, which is logged)."""
    path = os.path.join(directory, FILE_NAME)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return 0
    except OSError as exc:
        logger.warning("could not read the speculative history %s: %s", path, exc)
        return 0
    try:
        sequences = decode(data, fingerprint, vocab_size)
    except HistoryFileError as exc:
        logger.warning("speculative history %s not used: %s", path, exc)
        return 0
    for tenant, token_ids in sequences:
        store.record(tenant, token_ids)
    logger.info("speculative history: %d tokens of %d tenants from %s", store.num_tokens,
                store.stats().num_tenants, path)
    return store.num_tokens
