"""Long prefills chunked beside short ones (``--long-prefill-token-threshold``,
``--max-long-partial-prefills``): a request arriving during a long prefill waits for one chunk of
it, not all of it; long prompts take turns; a request waiting for a block another prefill computes
lets the unrelated ones behind it go; greedy tokens are those of the unchunked schedule."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
from support.scheduler_parts import FakeRunner, drive, make_sched, reference, req, step
from support.servers import REPO_ROOT, free_port, subprocess_env

from kvhive.request import RequestStatus
from kvhive.scheduler_args import add_scheduler_args, build_scheduler_config


def first_token_step(plans, request_id):
    """Index of the step that sampled ``request_id``'s first token."""
    return next(i for i, p in enumerate(plans) for s in p.seqs if s.request_id == request_id and s.sample)


def test_a_long_prefill_is_chunked_at_the_threshold_and_a_short_arrival_goes_beside_it():
    sched = make_sched(budget=64, long_prefill=16)
    runner = FakeRunner(sched)
    long = req("long", range(100, 160), max_tokens=4)          # 60 tokens: four chunks of <= 16
    sched.add_request(long)
    plan, _ = step(sched, runner)
    assert [(s.request_id, s.num_new_tokens) for s in plan.seqs] == [("long", 16)]
    short = req("short", range(10), max_tokens=4)              # arrives during the long prefill
    sched.add_request(short)
    plan, _ = step(sched, runner)
    assert {s.request_id: s.num_new_tokens for s in plan.seqs} == {"short": 10, "long": 16}
    drive(sched, runner)
    assert long.output_token_ids == reference(long.prompt_token_ids, 4)
    assert short.output_token_ids == reference(short.prompt_token_ids, 4)


def test_without_a_threshold_the_long_prefill_takes_the_budget_and_the_arrival_waits():
    sched = make_sched(budget=64, long_prefill=0)
    runner = FakeRunner(sched)
    sched.add_request(req("long", range(100, 220), max_tokens=2))   # 120 tokens: 64 + 56
    step(sched, runner)
    sched.add_request(req("short", range(10), max_tokens=2))
    plan, _ = step(sched, runner)
    assert {s.request_id: s.num_new_tokens for s in plan.seqs} == {"long": 56, "short": 8}


def test_long_prompts_take_turns_and_a_short_one_behind_them_is_not_held():
    sched = make_sched(budget=64, long_prefill=16, max_num_seqs=4)
    a, b = req("a", range(100, 148), max_tokens=3), req("b", range(200, 248), max_tokens=3)
    c = req("c", range(300, 308), max_tokens=3)
    for r in (a, b, c):
        sched.add_request(r)
    plans = drive(sched)
    first = plans[0].seqs
    assert {s.request_id: s.num_new_tokens for s in first} == {"a": 16, "c": 8}
    for plan in plans:
        long_chunks = [s for s in plan.seqs if s.request_id in ("a", "b") and 48 - s.start_pos > 16]
        assert len(long_chunks) <= 1                        # one long prefill a step
        assert all(s.num_new_tokens <= 16 for s in long_chunks)
    assert first_token_step(plans, "c") < first_token_step(plans, "a") < first_token_step(plans, "b")
    for r in (a, b, c):
        assert r.output_token_ids == reference(r.prompt_token_ids, 3)


def test_two_long_places_let_two_long_prompts_prefill_together():
    sched = make_sched(budget=64, long_prefill=16, max_long=2)
    for rid, start in (("a", 100), ("b", 200)):
        sched.add_request(req(rid, range(start, start + 48), max_tokens=2))
    plans = drive(sched)
    assert {s.request_id: s.num_new_tokens for s in plans[0].seqs} == {"a": 16, "b": 16}


def test_a_request_waiting_for_a_block_in_flight_lets_an_unrelated_one_behind_it_go():
    sched = make_sched(block_size=4, budget=64, long_prefill=16)
    runner = FakeRunner(sched)
    shared = list(range(500, 540))                            # 40 tokens, 10 blocks
    first = req("first", shared + [1, 2], max_tokens=2)
    sched.add_request(first)
    step(sched, runner)                                       # first computes 16 of them
    twin = req("twin", shared + [3, 4], max_tokens=2)         # needs the blocks first computes
    other = req("other", range(700, 706), max_tokens=2)
    sched.add_request(twin)
    sched.add_request(other)
    plan, _ = step(sched, runner)
    assert {s.request_id for s in plan.seqs} == {"first", "other"}
    assert twin.status is RequestStatus.WAITING
    drive(sched, runner)
    assert twin.num_cached_tokens >= 40                       # a hit, not computed twice
    for r in (first, twin, other):
        assert r.output_token_ids == reference(r.prompt_token_ids, 2)


def test_chunked_and_unchunked_schedules_give_the_same_tokens_under_load():
    outputs = {}
    for threshold in (0, 8, 24):
        sched = make_sched(budget=40, long_prefill=threshold, max_num_seqs=3, num_blocks=48)
        rs = [req(f"r{i}", range(i * 50, i * 50 + 10 + 9 * i), max_tokens=5) for i in range(6)]
        for r in rs:
            sched.add_request(r)
        drive(sched)
        outputs[threshold] = [r.output_token_ids for r in rs]
        assert outputs[threshold] == [reference(r.prompt_token_ids, 5) for r in rs]


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-model-len", type=int, default=None)
    add_scheduler_args(p.add_argument_group("x"))
    return p.parse_args(list(argv))


@pytest.mark.parametrize(("argv", "threshold"), [
    ((), 512), (("--device", "cuda"),  0), (("--long-prefill-token-threshold", "0"), 0),
    (("--long-prefill-token-threshold", "256", "--device", "cuda"), 256),
    (("--max-num-batched-tokens", "300"), 300),
])
def test_the_threshold_is_512_on_cpu_and_off_on_cuda_unless_given(argv, threshold):
    assert build_scheduler_config(parse(*argv)).long_prefill_token_threshold == threshold


@pytest.mark.parametrize("argv", [("--long-prefill-token-threshold", "4096"), ("--max-long-partial-prefills", "0"),
                                  ("--max-long-partial-prefills", "9")])
def test_out_of_range_values_are_refused_naming_the_flag(argv):
    with pytest.raises(ValueError, match=argv[0]):
        build_scheduler_config(parse(*argv))


@pytest.mark.parametrize(("args", "named"), [
    (["--long-prefill-token-threshold", "-3"], "--long-prefill-token-threshold: must be auto or >= 0"),
    (["--long-prefill-token-threshold", "many"], "--long-prefill-token-threshold: expected auto or a token count"),
    (["--long-prefill-token-threshold", "4096"], "--long-prefill-token-threshold must be 0 (off) to"),
    (["--max-long-partial-prefills", "0"], "--max-long-partial-prefills must be 1 to --max-num-seqs"),
])
def test_kvhive_serve_exits_2_naming_the_flag(args, named):
    done = subprocess.run([sys.executable, "-m", "kvhive.cli", "serve", "--port", str(free_port()), *args],
                          capture_output=True, text=True, timeout=60, cwd=REPO_ROOT, env=subprocess_env())
    assert done.returncode == 2, done.stderr
    assert named in done.stderr, done.stderr
