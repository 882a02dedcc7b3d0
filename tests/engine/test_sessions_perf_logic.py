"""The session path never does more work than plain prefix caching (tiny random model).

Checks the sessions target ("the session path <= the prefix-caching path at every turn") by what
the engine computes, not by timings: for each turn, the steps up to the first token, the tokens
run through the model, and the preemptions, on the two shapes of bench/sessions_ttft.py:
a chat whose history carries the engine's own replies (the session resumes) and the
../shared/bench/multiturn.py shape (a shared system prompt, canned replies, so each turn diverges
from the session and falls back to prefix matching, while an earlier conversation's session
still holds the system prompt's blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from support.engines import GREEDY, make_engine

SYSTEM = [(7 * i) % 200 + 3 for i in range(26)]       # 6.5 blocks of 4: a partial last block


@dataclass
class TurnWork:
    """What one request cost the engine."""

    steps_to_first_token: int
    tokens_to_first_token: int       # tokens the model computed up to the first sampled token
    tokens_computed: int             # over the whole request
    cached: int
    output: list[int]


def run_turn(engine, rid: str, prompt: list[int], session_id: str | None) -> TurnWork:
    """Run one request alone to the end, counting the model's work from the plans it ran."""
    plans = []
    real = engine.runner.execute

    def execute(plan):
        plans.append([(s.request_id, s.num_new_tokens, s.sample) for s in plan.seqs])
        return real(plan)

    engine.runner.execute = execute
    engine.add_request(rid, prompt, GREEDY, session_id=session_id)
    output, cached = [], -1
    try:
        for _ in range(1000):
            for out in engine.step():
                output += out.new_token_ids
                if out.finished:
                    cached = out.num_cached_tokens
            if not engine.has_unfinished():
                break
    finally:
        engine.runner.execute = real
    engine.scheduler.kv.pool.check_integrity()
    first = next(i for i, plan in enumerate(plans) if any(s for _, _, s in plan))
    return TurnWork(steps_to_first_token=first + 1,
                    tokens_to_first_token=sum(n for plan in plans[:first + 1] for _, n, _ in plan),
                    tokens_computed=sum(n for plan in plans for _, n, _ in plan),
                    cached=cached, output=output)


def conversations(engine, sessions: bool, canned: bool, num_convs: int = 2, num_turns: int = 3):
    """Sequential conversations over a shared system prompt; returns each turn's TurnWork."""
    work = []
    for conv in range(num_convs):
        history = list(SYSTEM)
        for t in range(num_turns):
            prompt = history + [100 + 10 * conv + t, 101 + t, 102, 103 + conv, 104 + t]
            w = run_turn(engine, f"c{conv}-t{t}", prompt, f"c{conv}" if sessions else None)
            work.append(w)
            reply = [240 + t, 241, 242 + conv] if canned else w.output
            history = prompt + reply
    return work


@pytest.mark.parametrize("canned", [False, True], ids=["own-replies", "canned-replies"])
def test_session_turns_do_no_more_work_than_prefix_turns(tokenizer, canned):
    # A pool with room for everything: any preemption would be the held sessions' doing.
    sess_engine, prefix_engine = make_engine(tokenizer, num_blocks=96), make_engine(tokenizer, num_blocks=96)
    sess = conversations(sess_engine, sessions=True, canned=canned)
    prefix = conversations(prefix_engine, sessions=False, canned=canned)
    assert [w.output for w in sess] == [w.output for w in prefix]
    for i, (s, p) in enumerate(zip(sess, prefix, strict=True)):
        assert s.steps_to_first_token <= p.steps_to_first_token, i
        assert s.tokens_to_first_token <= p.tokens_to_first_token, i
        assert s.tokens_computed <= p.tokens_computed, i
        assert s.cached >= p.cached, i
    assert sess_engine.scheduler.num_preemptions == prefix_engine.scheduler.num_preemptions == 0
    if canned:
        # Every turn diverges from its session (the canned reply is not the engine's): the
        # session path is then exactly the prefix path, held blocks of the other session included.
        assert [(w.steps_to_first_token, w.tokens_computed, w.cached) for w in sess] == \
               [(w.steps_to_first_token, w.tokens_computed, w.cached) for w in prefix]
    else:
        # Resumed turns compute only what the session does not hold: the turn's new tokens
        # (and the last reply token, which was sampled but never run through the model).
        for conv in range(2):
            for t in range(1, 3):
                earlier = sess[3 * conv:3 * conv + t]
                assert sess[3 * conv + t].tokens_to_first_token == 5 + 1
                assert sess[3 * conv + t].cached == len(SYSTEM) + 5 * t + sum(len(w.output) for w in earlier) - 1


def test_prefill_step_plans_match_prefix_path(tokenizer):
    # The multiturn.py shape, step by step: the session engine runs the same plans (tokens,
    # positions and block-table lengths) as the prefix engine, so no turn can be slower by design.
    engines = {mode: make_engine(tokenizer, num_blocks=96) for mode in ("sessions", "prefix")}
    plans = {mode: [] for mode in engines}
    for mode, engine in engines.items():
        real = engine.runner.execute

        def execute(plan, real=real, log=plans[mode]):
            log.append([(s.start_pos, s.num_new_tokens, len(s.block_table)) for s in plan.seqs])
            return real(plan)

        engine.runner.execute = execute
        conversations(engine, sessions=mode == "sessions", canned=True)
    assert plans["sessions"] == plans["prefix"]
