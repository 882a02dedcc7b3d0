"""Idle sessions under pool pressure: when requests need blocks the free and evictable ones cannot
give, sessions' device pins go, least recently used first, so every request runs at once; a
spilled session's next turn recomputes what it lost and samples what an uncached run samples."""

from __future__ import annotations

from support.scheduler_parts import FakeRunner, drive, make_sched, reference, req, step

from kvhive.request import RequestStatus

NUM_SESSIONS = 20


def sessions_filling_the_pool():
    """A scheduler (41 usable blocks of 4, 8 running at most) whose idle sessions hold all but a
    few blocks, and each session's history; ``s0`` had a second turn, so it is the most recently
    used and ``s1`` the least."""
    sched = make_sched(num_blocks=42, max_num_seqs=8, budget=256)
    runner = FakeRunner(sched)
    history = {}
    for k in range(NUM_SESSIONS):
        prompt = [1 + (k * 7 + j) % 90 for j in range(7)]
        sched.add_request(req(f"s{k}-t0", prompt, max_tokens=1, session_id=f"s{k}"))
        drive(sched, runner)
        history[f"s{k}"] = prompt + reference(prompt, 1)
    prompt = history["s0"] + [3, 4]
    sched.add_request(req("s0-t1", prompt, max_tokens=1, session_id="s0"))
    drive(sched, runner)
    history["s0"] = prompt + reference(prompt, 1)
    use_order = [f"s{k}" for k in range(1, NUM_SESSIONS)] + ["s0"]
    assert sched.kv.sessions.ids() == use_order
    assert sched.kv.pool.num_free_blocks <= 1 and sched.num_session_spills == 0
    return sched, runner, history, use_order


def test_every_request_runs_at_once_and_sessions_go_least_recently_used_first():
    sched, runner, history, use_order = sessions_filling_the_pool()
    prompts = {f"r{i}": [50 + i + j for j in range(8)] for i in range(8)}
    requests = [req(rid, prompt, max_tokens=6) for rid, prompt in prompts.items()]
    for request in requests:
        sched.add_request(request)
    plan, _ = step(sched, runner)
    assert len(plan.seqs) == 8 and len(sched.running) == 8 and not sched.waiting
    assert all(r.status is RequestStatus.RUNNING for r in requests)
    num_spilled = NUM_SESSIONS - len(sched.kv.sessions.ids())
    assert num_spilled > 0 and sched.num_session_spills == num_spilled
    assert sched.kv.sessions.ids() == use_order[num_spilled:]        # the least recently used went
    drive(sched, runner)
    # Decodes that outgrew their blocks spilled more sessions; nothing was preempted.
    assert sched.num_preemptions == 0
    assert 0 < len(sched.kv.sessions.ids()) < NUM_SESSIONS - num_spilled + 1
    assert sched.kv.sessions.ids() == use_order[NUM_SESSIONS - len(sched.kv.sessions.ids()):]
    for request in requests:
        assert request.output_token_ids == reference(prompts[request.request_id], 6)


def test_a_spilled_session_s_next_turn_matches_an_uncached_run():
    sched, runner, history, use_order = sessions_filling_the_pool()
    for i in range(8):
        sched.add_request(req(f"r{i}", [50 + i + j for j in range(8)], max_tokens=6))
    drive(sched, runner)
    spilled = [sid for sid in use_order if sched.kv.sessions.get(sid) is None]
    kept = [sid for sid in use_order if sched.kv.sessions.get(sid) is not None]
    assert spilled and kept
    for sid in spilled + kept:
        prompt = history[sid] + [9, 8, 7]
        turn = req(f"{sid}-t2", prompt, max_tokens=5, session_id=sid)
        sched.add_request(turn)
        drive(sched, runner)
        assert turn.output_token_ids == reference(prompt, 5), sid
        assert sched.kv.sessions.get(sid) is not None            # it holds its new history
