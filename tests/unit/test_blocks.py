"""Block hashing: golden vectors, chaining and isolation."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvhive.core.blocks import ExtraKeys, hash_block, hash_blocks, hash_tail, root_hash

R0 = root_hash(0)


def test_golden_vectors():
    assert R0.hex() == "aad915a7a6139a8fb1531d1b0110a9b1"
    r42 = root_hash(42, "smollm2-test")
    assert r42.hex() == "15cfc0b5cb64b347e900da1fd074a234"
    toks = list(range(40))
    assert [h.hex() for h in hash_blocks(toks, 16, R0)] == [
        "081bebe53225fdca97fda79c2b6645f4", "0f3e5ae68d8bd0fb4928a86ae97f67a2"]
    assert [h.hex() for h in hash_blocks(toks, 16, R0, ExtraKeys(cache_salt="tenant-a"))] == [
        "189ebd42566077cb48ca4c83574db858", "11a92048bbe2b5f72c60d31f9989204d"]
    assert [h.hex() for h in hash_blocks(toks, 4, r42)][:3] == [
        "eb34d477959d335def1ec3daa25523f6", "5ae666a3489b5573c9feb0657b68c338",
        "8752884eaca8f64df0c893d0cf3ffa5b"]
    assert ExtraKeys(cache_salt="tenant-a").encode().hex() == "730800000074656e616e742d61"


def test_chain_matches_single_block_function():
    toks = list(range(100, 164))
    chain = hash_blocks(toks, 16, R0)
    prev = R0
    for i, h in enumerate(chain):
        prev = hash_block(prev, toks[i * 16:(i + 1) * 16])
        assert prev == h


def test_extend_equals_full_chain():
    toks = list(range(7, 7 + 16 * 9 + 5))
    full = hash_blocks(toks, 16, R0, ExtraKeys(cache_salt="x"))
    head = hash_blocks(toks[:16 * 4 + 3], 16, R0, ExtraKeys(cache_salt="x"))
    tail = hash_blocks(toks, 16, R0, ExtraKeys(cache_salt="x"), start_block=4, parent=head[-1])
    assert head + tail == full
    assert hash_blocks(toks, 16, R0, start_block=20, parent=full[-1]) == []


def test_prefix_property_and_divergence():
    a = list(range(64))
    b = a[:40] + [999] + a[41:]
    ha, hb = hash_blocks(a, 16, R0), hash_blocks(b, 16, R0)
    assert ha[:2] == hb[:2] and ha[2] != hb[2] and ha[3] != hb[3]


def test_salt_seed_and_fingerprint_isolate():
    toks = list(range(32))
    base = hash_blocks(toks, 16, R0)
    assert hash_blocks(toks, 16, R0, ExtraKeys(cache_salt="a"))[0] != base[0]
    assert hash_blocks(toks, 16, R0, ExtraKeys(cache_salt="a")) != \
        hash_blocks(toks, 16, R0, ExtraKeys(cache_salt="b"))
    assert hash_blocks(toks, 16, root_hash(1)) != base
    assert hash_blocks(toks, 16, root_hash(0, "other-model")) != base
    # length-prefixed fields: moving a character between salt and adapter changes the key
    assert ExtraKeys("ab", "c").encode() != ExtraKeys("a", "bc").encode()
    assert ExtraKeys().encode() == b""


def test_bad_arguments():
    with pytest.raises(ValueError):
        root_hash(-1)
    with pytest.raises(ValueError):
        hash_blocks(list(range(32)), 16, R0, start_block=1)


def test_root_does_not_depend_on_process():
    code = "from kvhive.core.blocks import root_hash; print(root_hash(7, 'm').hex())"
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={"PYTHONHASHSEED": str(s), "PATH": ""}, check=True).stdout
            for s in (1, 2)}
    assert len(outs) == 1


def test_a_partial_block_is_named_apart_from_every_full_block():
    root = root_hash(0)
    tokens = list(range(40))
    full = hash_blocks(tokens, 16, root)
    tail = hash_tail(tokens, 16, root, full)
    assert tail is not None and tail not in full
    assert tail != hash_block(full[-1], tokens[32:])        # a full block's rule on the same tokens
    assert hash_tail(tokens[:39], 16, root, full) != tail   # every token counts
    assert hash_tail(tokens[:32], 16, root, full) is None   # no partial block
    # A partial first block carries the salt, as block 0 does.
    short = [5, 6, 7]
    salted = hash_tail(short, 16, root, [], ExtraKeys(cache_salt="a"))
    assert salted != hash_tail(short, 16, root, []) and salted != hash_tail(short, 16, root, [], ExtraKeys(cache_salt="b"))
    # After the first block the salt is in the chain, not mixed in again.
    assert hash_tail(tokens, 16, root, full, ExtraKeys(cache_salt="a")) == tail
