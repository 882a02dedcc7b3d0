"""A forked session in the engine (tiny random model, real KV): with prefix caching off, the fork
reads the parent's full blocks only through its own holding, and the greedy answers of turns on
either side equal an uncached engine's for the same conversation."""

from __future__ import annotations

from support.engines import make_engine, run, turn

TURN1 = [5 + 3 * i for i in range(11)]


def plain(tokenizer, prompt: list[int]) -> list[int]:
    engine = make_engine(tokenizer, prefix=False)
    return run(engine, {"x": prompt})["x"][0]


def test_turns_on_a_fork_and_its_parent_match_an_uncached_engine(tokenizer):
    engine = make_engine(tokenizer, prefix=False)
    first, _, _ = turn(engine, "p1", TURN1, "p")
    history = TURN1 + first
    shared = engine.fork_session("p", "c", len(history))
    assert shared == (len(history) - 1) // 4 * 4 > 0          # full blocks only (block size 4)
    child_prompt, parent_prompt = history + [40, 41, 42], history + [50, 51]
    child, cached, _ = turn(engine, "c1", child_prompt, "c")
    assert cached == shared and child == plain(tokenizer, child_prompt)
    parent, cached, _ = turn(engine, "p2", parent_prompt, "p")
    assert cached == len(history) - 1 and parent == plain(tokenizer, parent_prompt)
    # The child goes on from its own turn, the parent's since unseen by it.
    again = child_prompt + child + [60]
    tokens, cached, _ = turn(engine, "c2", again, "c")
    assert tokens == plain(tokenizer, again) and cached == len(child_prompt) + len(child) - 1
    engine.end_session("p")
    last = again + tokens + [70]
    assert turn(engine, "c3", last, "c")[0] == plain(tokenizer, last)
