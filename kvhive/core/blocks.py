"""Block hashing: the one function the engine, the stores and the router all call (torch-free).

Spec (docs/hashing.md has golden vectors):

    root     = H(b"kvhive-root-v1" || seed as 8-byte little-endian || model fingerprint)
    h_i      = H(h_{i-1} || tokens[iB:(i+1)B] as little-endian int32 || extra_i)    (h_{-1} = root)
    extra_0  = encoded extra keys (cache salt, adapter id) when any is set, else b""
    extra_i  = b"" for i > 0 (the chain carries block 0's salt to every later block)

H is xxh3-128, digests are 16 bytes. Only full blocks get a hash. Extra keys are encoded as
length-prefixed fields, so ("ab", "c") and ("a", "bc") never collide.

A prompt's partial last block is named only on the prefill-to-decode channel, never cached:

    tail = H(b"kvhive-tail-v1" || h_{k-1} || tokens[kB:] as little-endian int32 || extra_k)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

HASH_BYTES = 16
_ROOT_TAG = b"kvhive-root-v1"
_TAIL_TAG = b"kvhive-tail-v1"


def _h(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


def root_hash(seed: int, model_fingerprint: str = "") -> bytes:
    """h_{-1}: derived from an explicit seed and the model fingerprint, never from the process."""
    if not 0 <= seed < 2**64:
        raise ValueError(f"hash seed must fit in 64 bits, got {seed}")
    return _h(_ROOT_TAG + seed.to_bytes(8, "little") + model_fingerprint.encode())


@dataclass(frozen=True)
class ExtraKeys:
    """Keys mixed into block 0 so that blocks are shared only between equal keys."""

    cache_salt: str | None = None
    adapter_id: str | None = None

    def encode(self) -> bytes:
        """Length-prefixed encoding; b"" when no key is set."""
        if self.cache_salt is None and self.adapter_id is None:
            return b""
        out = bytearray()
        for tag, value in ((b"s", self.cache_salt), (b"a", self.adapter_id)):
            if value is not None:
                raw = value.encode()
                out += tag + len(raw).to_bytes(4, "little") + raw
        return bytes(out)


def hash_block(parent: bytes, tokens: Sequence[int] | np.ndarray, extra: bytes = b"") -> bytes:
    """h_i = H(parent || tokens as little-endian int32 || extra)."""
    raw = np.asarray(tokens, dtype="<i4").tobytes()
    return _h(parent + raw + extra)


def hash_blocks(
    tokens: Sequence[int],
    block_size: int,
    root: bytes,
    extra: ExtraKeys | None = None,
    start_block: int = 0,
    parent: bytes | None = None,
) -> list[bytes]:
    """Hashes of the full blocks of ``tokens`` from block ``start_block`` on.

    To extend a chain, pass the hash of block ``start_block - 1`` as ``parent``; the tokens are
    always the whole sequence (block i covers tokens[i*B:(i+1)*B]).
    """
    if start_block > 0 and parent is None:
        raise ValueError("hash_blocks: extending a chain needs the parent hash")
    n_full = len(tokens) // block_size
    if start_block >= n_full:
        return []
    arr = np.asarray(tokens[start_block * block_size: n_full * block_size], dtype="<i4")
    raw = arr.tobytes()
    step = block_size * 4
    extra0 = extra.encode() if extra is not None else b""
    prev = root if start_block == 0 else parent
    out: list[bytes] = []
    for j in range(n_full - start_block):
        i = start_block + j
        prev = _h(prev + raw[j * step:(j + 1) * step] + (extra0 if i == 0 else b""))
        out.append(prev)
    return out


def hash_tail(tokens: Sequence[int], block_size: int, root: bytes, full_hashes: Sequence[bytes],
              extra: ExtraKeys | None = None) -> bytes | None:
    """The name of the partial block after the full blocks of ``tokens`` (None when there is none):
    chained from ``full_hashes`` (the hashes of those full blocks), tagged so that it never equals
    a full block's hash."""
    k = len(tokens) // block_size
    if k * block_size == len(tokens):
        return None
    parent = full_hashes[k - 1] if k else root
    extra0 = extra.encode() if extra is not None and k == 0 else b""
    return _h(_TAIL_TAG + parent + np.asarray(tokens[k * block_size:], dtype="<i4").tobytes() + extra0)
