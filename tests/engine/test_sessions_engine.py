"""Sessions in the engine: held blocks resume without hashing, divergence falls back to prefix
matching, end_session frees, and spilling under device pressure (tiny random model)."""

from __future__ import annotations

from support.engines import GREEDY, make_engine, turn

from kvhive.config import StoreConfig
from kvhive.request import SamplingParams


def conversation(engine, turns, session_id=None):
    history, outs = [], []
    for i, new in enumerate(turns):
        prompt = history + new
        tokens, cached, _ = turn(engine, f"t{i}", prompt, session_id)
        outs.append((tokens, cached))
        history = prompt + tokens
    return outs


TURNS = [[5 + i + 7 * t for i in range(9 + t)] for t in range(5)]


def test_session_turns_match_plain_and_resume_partial_block(tokenizer):
    plain = conversation(make_engine(tokenizer, prefix=False), TURNS)
    engine = make_engine(tokenizer)
    held = conversation(engine, TURNS, session_id="s1")
    assert [t for t, _ in held] == [t for t, _ in plain]
    history = 0
    for i, (tokens, cached) in enumerate(held):
        if i:
            # Everything the previous turn computed, partial last block included (block size 4).
            assert cached == history - 1
        history += len(TURNS[i]) + len(tokens)
    assert engine.scheduler.kv.sessions.get("s1") is not None


def test_resume_does_not_rehash(tokenizer, monkeypatch):
    engine = make_engine(tokenizer)
    first, _, _ = turn(engine, "a", TURNS[0], "s")
    import kvhive.kv.manager as manager

    calls = []
    real = manager.hash_blocks
    monkeypatch.setattr(manager, "hash_blocks", lambda *a, **k: calls.append(k.get("start_block", 0)) or real(*a, **k))
    turn(engine, "b", TURNS[0] + first + TURNS[1], "s")
    # Only blocks after the held prefix are hashed, never block 0.
    assert calls and 0 not in calls


def test_diverging_prompt_falls_back_to_prefix_match(tokenizer):
    engine = make_engine(tokenizer)
    first, _, _ = turn(engine, "a", TURNS[0] + TURNS[1], "s")
    tokens, cached, _ = turn(engine, "b", TURNS[0] + [1, 2, 3], "s")
    assert cached == len(TURNS[0])                   # the common part: full blocks and a copied tail
    assert len(tokens) == GREEDY.max_tokens
    # The session now follows the new history.
    assert engine.scheduler.kv.sessions.get("s").token_ids[:len(TURNS[0]) + 3] == TURNS[0] + [1, 2, 3]


def test_end_session_frees(tokenizer):
    engine = make_engine(tokenizer)
    turn(engine, "a", TURNS[0], "s", end=True)
    assert engine.scheduler.kv.sessions.get("s") is None
    turn(engine, "b", TURNS[0], "t")
    assert engine.scheduler.kv.sessions.num_blocks > 0
    engine.end_session("t")
    assert engine.scheduler.kv.sessions.num_blocks == 0
    assert engine.scheduler.kv.pool.stats().num_used == 0


def test_no_tier_pins_session_blocks(tokenizer):
    engine = make_engine(tokenizer, num_blocks=40)
    turn(engine, "a", TURNS[0], "s")
    pinned = {b.block_id for b in engine.scheduler.kv.sessions.get("s").blocks}
    for i in range(4):
        turn(engine, f"f{i}", [200 + i] * 60)          # floods the 40-block pool
    assert {b.block_id for b in engine.scheduler.kv.sessions.get("s").blocks} == pinned


def test_spill_to_tier_under_pressure_and_come_back(tokenizer, tmp_path):
    # Device pool smaller than the live sessions: holdings spill to the tier and come back.
    engine = make_engine(tokenizer, num_blocks=24, store=StoreConfig(cpu_offload_gb=0.01))
    prompts = {f"s{i}": [(40 * i + j) % 250 + 1 for j in range(30)] for i in range(4)}     # ~11 blocks each
    outs = {}
    for sid, prompt in prompts.items():
        outs[sid], _, _ = turn(engine, sid, prompt, sid)
        engine.connector_worker.wait_for_save()
    assert engine.scheduler.num_session_spills > 0
    fresh = make_engine(tokenizer, prefix=False)
    for sid, prompt in prompts.items():
        tokens, cached, _ = turn(engine, sid + "-2", prompt + outs[sid] + [7, 8, 9], sid)
        expect, _, _ = turn(fresh, sid + "-2", prompt + outs[sid] + [7, 8, 9])
        assert tokens == expect
        assert cached >= 28, (sid, cached)
        engine.connector_worker.wait_for_save()


def test_idle_sessions_never_stall_a_request_without_tiers(tokenizer):
    # Three idle sessions hold 39 of the 39 usable blocks and no tier can take them: the request
    # that does not fit takes the least recently used holding's blocks instead of waiting forever.
    engine = make_engine(tokenizer, num_blocks=40)
    for k in range(3):
        turn(engine, f"s{k}", [10 + k + j % 50 for j in range(40)], f"s{k}")
    assert engine.scheduler.kv.pool.num_free_blocks == 0
    tokens, _, _ = turn(engine, "big", [200 + j % 30 for j in range(60)])
    assert len(tokens) == GREEDY.max_tokens
    kv = engine.scheduler.kv
    assert kv.sessions.get("s0") is None and kv.sessions.get("s2") is not None
    assert engine.scheduler.num_session_spills >= 1


def test_idle_sessions_give_way_to_concurrent_requests_and_answer_like_an_uncached_run(tokenizer):
    # Idle sessions hold all 39 usable blocks and no tier can take them: four requests still run
    # at once (the least recently used sessions' pins go), and every session's next turn, spilled
    # or not, samples what an engine without any cache samples.
    engine = make_engine(tokenizer, num_blocks=40, max_seqs=4)
    fresh = make_engine(tokenizer, prefix=False)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    history = {}
    for k in range(13):
        prompt = [10 + k + j for j in range(10)]
        tokens, _, _ = turn(engine, f"s{k}-0", prompt, f"s{k}", sampling=one)
        history[f"s{k}"] = prompt + tokens
    kv = engine.scheduler.kv
    assert kv.pool.num_free_blocks == 0 and len(kv.sessions.ids()) == 13
    prompts = {f"r{i}": [150 + 3 * i + j % 7 for j in range(20)] for i in range(4)}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, GREEDY)
    outs = {rid: [] for rid in prompts}
    for out in engine.step():
        outs[out.request_id] += out.new_token_ids
    assert len(engine.scheduler.running) == 4 and not engine.scheduler.waiting
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] += out.new_token_ids
    assert engine.scheduler.num_preemptions == 0
    spilled = [sid for sid in history if kv.sessions.get(sid) is None]
    assert spilled == [f"s{k}" for k in range(len(spilled))] and 0 < len(spilled) < 13
    for rid, prompt in prompts.items():
        assert outs[rid] == turn(fresh, rid, prompt)[0]
    for sid, past in history.items():
        prompt = past + [7, 8, 9]
        assert turn(engine, f"{sid}-1", prompt, sid)[0] == turn(fresh, f"{sid}-1", prompt)[0], sid
