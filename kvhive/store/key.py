"""Store keys: what names one KV block in every tier (memory, disk, Redis).

A key is model fingerprint + KV layout version + dtype + block size + block hash (DESIGN.md,
"Store objects"). Two engines share an object only when all five agree, so a block computed by
another model, another layout or another dtype is never found under this key.

Encoding (stable across processes and versions; it is the Redis key and the disk index key):

    b"kvh1:" + layout_version + ":" + dtype + ":" + block_size + ":" + fingerprint + ":" + hash hex

Every field before the fingerprint is free of ":" and the hash is a fixed 32 hex digits at the
end, so the encoding is unambiguous whatever the fingerprint contains.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

KEY_PREFIX = b"kvh1:"
HASH_BYTES = 16


def _check_fields(fingerprint: str, layout_version: int, dtype: str, block_size: int) -> None:
    if not fingerprint:
        raise ValueError("store key: model fingerprint must not be empty")
    if layout_version < 0:
        raise ValueError(f"store key: layout version must be >= 0, got {layout_version}")
    if not dtype or ":" in dtype:
        raise ValueError(f"store key: dtype must be a non-empty name without ':', got {dtype!r}")
    if block_size <= 0:
        raise ValueError(f"store key: block size must be > 0, got {block_size}")


def _encode_prefix(fingerprint: str, layout_version: int, dtype: str, block_size: int) -> bytes:
    return KEY_PREFIX + f"{layout_version}:{dtype}:{block_size}:{fingerprint}:".encode()


@dataclass(frozen=True)
class StoreKey:
    """The name of one KV block in a store: model, layout, dtype, block size and block hash."""

    model_fingerprint: str
    layout_version: int
    dtype: str
    block_size: int
    block_hash: bytes

    def __post_init__(self) -> None:
        _check_fields(self.model_fingerprint, self.layout_version, self.dtype, self.block_size)
        if len(self.block_hash) != HASH_BYTES:
            raise ValueError(f"store key: block hash must be {HASH_BYTES} bytes, got {len(self.block_hash)}")

    def encode(self) -> bytes:
        """The compact, stable byte form used as the Redis key and the disk index key."""
        prefix = _encode_prefix(self.model_fingerprint, self.layout_version, self.dtype, self.block_size)
        return prefix + self.block_hash.hex().encode()


@dataclass(frozen=True)
class KeySpace:
    """Makes StoreKeys for one (model fingerprint, layout version, dtype, block size)."""

    model_fingerprint: str
    layout_version: int
    dtype: str
    block_size: int
    prefix: bytes = field(init=False, repr=False, compare=False)  # derived: the encoded key minus the hash

    def __post_init__(self) -> None:
        _check_fields(self.model_fingerprint, self.layout_version, self.dtype, self.block_size)
        object.__setattr__(self, "prefix", _encode_prefix(
            self.model_fingerprint, self.layout_version, self.dtype, self.block_size))

    def key(self, block_hash: bytes) -> StoreKey:
        """The key of the block with this hash."""
        return StoreKey(self.model_fingerprint, self.layout_version, self.dtype, self.block_size, block_hash)

    def keys(self, block_hashes: Iterable[bytes]) -> list[StoreKey]:
        """The keys of a chain of blocks, in order."""
        return [self.key(h) for h in block_hashes]
