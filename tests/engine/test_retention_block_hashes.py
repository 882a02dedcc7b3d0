"""A request with a retention (a prompt-cache pin) reports its full-block hashes: on its first
output after the prompt was computed and on its last; a request without one never does."""

from __future__ import annotations

from support.engines import GREEDY, make_engine

from kvhive.core.blocks import ExtraKeys, hash_blocks
from kvhive.core.retention import pin_only

PROMPT = [(7 * j) % 200 + 3 for j in range(18)]         # 4 full blocks of 4 and 2 tokens


def outputs(engine, rid, retention):
    engine.add_request(rid, PROMPT, GREEDY, cache_salt="s", retention=retention)
    got = []
    for _ in range(200):
        got += [out for out in engine.step() if out.request_id == rid]
        if not engine.has_unfinished():
            break
    return got


def test_a_request_with_a_retention_reports_its_block_hashes(tokenizer):
    engine = make_engine(tokenizer)
    try:
        got = outputs(engine, "pinned", pin_only(len(PROMPT), 60.0))
        reported = [i for i, out in enumerate(got) if out.block_hashes is not None]
        assert reported == [0, len(got) - 1] and got[-1].finished
        prompt_hashes = hash_blocks(PROMPT, 4, engine.scheduler.kv.root_hash, ExtraKeys(cache_salt="s"))
        assert list(got[0].block_hashes) == prompt_hashes
        assert list(got[-1].block_hashes[:4]) == prompt_hashes and len(got[-1].block_hashes) == (18 + 12) // 4
        assert all(out.block_hashes is None for out in outputs(engine, "plain", None))
    finally:
        engine.close()
