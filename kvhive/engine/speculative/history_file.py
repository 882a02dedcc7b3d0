"""The "history" drafter's store kept across a restart: one file in the disk cache dir.

With ``--disk-cache-dir`` the engine writes its ``HistoryStore`` there when it closes (a graceful
stop) and reads it back when it starts, so a restarted server drafts from the requests it answered
before, as it keeps their KV and sessions. The file holds the sequences in the order they were
kept (the oldest first, across tenants, so the caps evict the same ones after a restart), each
with its tenant; the n-gram index is rebuilt from them.

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
import zlib
from array import array
from collections.abc import Iterable, Sequence

from kvhive.core.atomic_file import atomic_write
from kvhive.engine.speculative.tenant_history import HistoryStore

logger = logging.getLogger(__name__)

FILE_NAME = "speculative-history.bin"
MAGIC = b"KVHHIST\x00"
VERSION = 1
_HEADER_LEN = struct.Struct("<I")
_CRC = struct.Struct("<I")


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


def save(store: HistoryStore, directory: str, fingerprint: str, vocab_size: int) -> None:
    """Write ``store`` to ``directory``'s history file; a write that fails (a full disk) is logged
    and leaves the previous file as it was."""
    path = os.path.join(directory, FILE_NAME)
    try:
        os.makedirs(directory, exist_ok=True)
        atomic_write(path, encode(store.sequences(), fingerprint, vocab_size))
    except OSError as exc:
        logger.warning("could not keep the speculative history in %s: %s", path, exc)
        return
    logger.info("kept the speculative history in %s (%d tokens)", path, store.num_tokens)


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
