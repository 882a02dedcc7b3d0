"""A forked session's device blocks: the child holds the parent's full blocks (never the partial
last one), turns on either side write only into their own blocks, and each side's answers equal an
uncached run of its own conversation (a whole scheduler over a fake runner that reads its "KV" back
through the block tables; no model)."""

from __future__ import annotations

from support.scheduler_parts import BLOCK_SIZE, FakeRunner, drive, make_kv, make_sched, park, reference, req


def run_turns(sched, runner, turns: dict[str, list[int]], max_tokens: int = 6) -> dict[str, list[int]]:
    """Run one turn per session at once (session id -> whole prompt); each one's output tokens."""
    requests = {sid: req(f"{sid}-{len(prompt)}", prompt, max_tokens=max_tokens, session_id=sid)
                for sid, prompt in turns.items()}
    for request in requests.values():
        sched.add_request(request)
    drive(sched, runner)
    return {sid: list(request.output_token_ids) for sid, request in requests.items()}


def held_slots(sched, runner, session_id: str) -> list:
    """What the session's held blocks hold, slot by slot."""
    blocks = sched.kv.sessions.get(session_id).blocks
    return [runner.slots.get(b.block_id * BLOCK_SIZE + i) for b in blocks for i in range(BLOCK_SIZE)]


def test_a_fork_shares_the_full_blocks_only_and_each_holding_keeps_its_reference():
    kv = make_kv(num_blocks=20)
    parent = park(kv, "p", range(10))                 # 2 full blocks and a partial one (9 computed)
    assert kv.sessions.fork("p", "c", 10) == 2 * BLOCK_SIZE
    held, child = kv.sessions.get("p"), kv.sessions.get("c")
    assert child.blocks == held.blocks[:2] and child.block_hashes == parent.block_hashes[:2]
    assert child.token_ids == list(range(8)) and child.num_computed_tokens == 8
    assert all(b.ref_cnt == 2 for b in child.blocks) and held.blocks[2].ref_cnt == 1
    assert kv.sessions.num_blocks == 3
    assert kv.sessions.fork("p", "c2", 5) == 4                     # at an earlier point: one block
    assert kv.sessions.fork("p", "c3", 3) == 0 and kv.sessions.get("c3") is None   # no full block
    assert kv.sessions.fork("nobody", "c4", 8) == 0
    assert kv.sessions.release("p") and all(b.ref_cnt >= 1 for b in child.blocks)
    kv.pool.check_integrity()
    assert kv.sessions.release("c") and kv.sessions.release("c2") and kv.sessions.num_blocks == 0
    kv.pool.check_integrity()


def test_turns_on_both_sides_of_a_fork_match_uncached_runs_and_never_change_the_other():
    sched = make_sched(num_blocks=64)
    runner = FakeRunner(sched)
    first = list(range(1, 11))
    history = first + run_turns(sched, runner, {"p": first})["p"]
    shared = sched.kv.sessions.fork("p", "c", len(history))
    assert shared == (len(history) - 1) // BLOCK_SIZE * BLOCK_SIZE > 0     # the last token has no KV yet
    child_before = held_slots(sched, runner, "c")
    prompts = {"p": history + [50, 51, 52], "c": history + [60, 61]}
    outputs = run_turns(sched, runner, prompts)
    for sid, prompt in prompts.items():
        assert outputs[sid] == reference(prompt, 6), sid
    # The parent's second turn and the child's first ran at once; a third on each goes on apart.
    again = {sid: prompts[sid] + outputs[sid] + [70 + i] for i, sid in enumerate(("p", "c"))}
    outputs = run_turns(sched, runner, again)
    for sid, prompt in again.items():
        assert outputs[sid] == reference(prompt, 6), sid
    # The parent ends: the child still reads its shared prefix, unchanged.
    parent_blocks = {b.block_id for b in sched.kv.sessions.get("p").blocks}
    sched.kv.sessions.release("p")
    child_now = held_slots(sched, runner, "c")
    assert child_now[:len(child_before)] == child_before
    assert parent_blocks & {b.block_id for b in sched.kv.sessions.get("c").blocks}
    last = again["c"] + outputs["c"] + [99]
    assert run_turns(sched, runner, {"c": last})["c"] == reference(last, 6)
    sched.kv.pool.check_integrity()


def test_a_fork_at_an_earlier_turn_continues_from_that_turn():
    sched = make_sched(num_blocks=64)
    runner = FakeRunner(sched)
    first = list(range(1, 14))
    turn1 = first + run_turns(sched, runner, {"p": first})["p"]
    second = turn1 + [40, 41, 42, 43, 44]
    run_turns(sched, runner, {"p": second})
    assert sched.kv.sessions.fork("p", "c", len(turn1)) == len(turn1) // BLOCK_SIZE * BLOCK_SIZE > 0
    other = turn1 + [80, 81, 82]
    request = req("c-1", other, max_tokens=6, session_id="c")
    sched.add_request(request)
    drive(sched, runner)
    assert list(request.output_token_ids) == reference(other, 6)
    assert request.num_cached_tokens == len(turn1) // BLOCK_SIZE * BLOCK_SIZE
