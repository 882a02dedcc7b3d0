"""The indexer's block-key cache: per-piece cached keys always equal hashing the whole prompt."""

from __future__ import annotations

import random

import xxhash

from kvhive.core.blocks import ExtraKeys, hash_blocks, root_hash
from kvhive.routing.indexer import BlockKeyCache
from kvhive.routing.prompts import PromptPieces

ROOT = root_hash(0, "fingerprint")


def split(ids: list[int], rng: random.Random) -> PromptPieces:
    """``ids`` in pieces of 1..40 tokens, each keyed by a chained hash of the pieces up to it (as the
    prefix store keys chunks)."""
    pieces, start, key = PromptPieces([], []), 0, b""
    while start < len(ids):
        end = min(len(ids), start + rng.randint(1, 40))
        key = xxhash.xxh3_128_digest(key + repr(ids[start:end]).encode())
        pieces.keys.append(key)
        pieces.ids.append(tuple(ids[start:end]))
        start = end
    return pieces


def expected(ids: list[int], block_size: int, salt: str | None) -> list[bytes]:
    return hash_blocks(ids, block_size, ROOT, ExtraKeys(cache_salt=salt))


def test_cached_keys_equal_whole_prompt_hashes() -> None:
    rng = random.Random(1)
    for block_size in (1, 4, 16, 64):
        cache = BlockKeyCache(block_size, ROOT)
        shared = [rng.randrange(1000) for _ in range(150)]
        for _ in range(30):
            ids = shared[:rng.randint(0, 150)] + [rng.randrange(1000) for _ in range(rng.randint(0, 60))]
            salt = rng.choice([None, "a", "key:x"])
            # The shared part is cut the same way each time (so its pieces are found again).
            pieces = split(ids, random.Random(len(ids) % 3))
            assert cache.block_keys(pieces, salt) == expected(ids, block_size, salt)
            assert cache.block_keys(pieces, salt) == expected(ids, block_size, salt)    # all cached


def test_salts_and_uncached_pieces() -> None:
    cache = BlockKeyCache(4, ROOT)
    ids = list(range(37))
    pieces = split(ids, random.Random(2))
    assert cache.block_keys(pieces, None) == expected(ids, 4, None)
    # The same pieces under another salt are other blocks, not the cached ones.
    assert cache.block_keys(pieces, "s") == expected(ids, 4, "s") != expected(ids, 4, None)
    # A token-id prompt (one unkeyed piece) is hashed and not cached.
    before = len(cache)
    assert cache.block_keys(PromptPieces([None], [tuple(ids)]), None) == expected(ids, 4, None)
    assert len(cache) == before
    assert cache.block_keys(PromptPieces([], []), None) == []


def test_bounded_lru() -> None:
    cache = BlockKeyCache(4, ROOT, max_pieces=5)
    ids = list(range(200))
    pieces = split(ids, random.Random(3))
    assert cache.block_keys(pieces, None) == expected(ids, 4, None)
    assert len(cache) == 5
    assert cache.block_keys(pieces, None) == expected(ids, 4, None)
