"""Scheduler policy against a fake runner that reads its "KV" back through the block tables."""

from __future__ import annotations

import random

import pytest
from support.scheduler_parts import VOCAB, FakeRunner, drive, make_sched, reference, req, step

from kvhive.connector.base import ConnectorMeta, FinishedTransfers, SchedulerOutput
from kvhive.engine.scheduler import Scheduler
from kvhive.engine.step import StepResult
from kvhive.kv.partial_copies import BlockCopy
from kvhive.request import FinishReason, Request, RequestStatus


def test_mixed_prefill_and_decode_in_one_step():
    sched = make_sched()
    runner = FakeRunner(sched)
    a = req("a", range(5))
    sched.add_request(a)
    step(sched, runner)
    sched.add_request(req("b", range(20, 40)))
    plan, _ = step(sched, runner)
    (sa, sb) = plan.seqs
    assert (sa.request_id, sa.token_ids, sa.start_pos, sa.sample) == ("a", [a.all_token_ids[5]], 5, True)
    assert (sb.request_id, sb.num_new_tokens, sb.start_pos, sb.sample) == ("b", 20, 0, True)


def test_chunked_prefill_respects_budget_and_samples_on_last_chunk():
    sched = make_sched(budget=16)
    prompt = list(range(1, 41))
    a = req("a", prompt, max_tokens=3)
    sched.add_request(a)
    plans = drive(sched)
    assert [(s.start_pos, s.num_new_tokens, s.sample) for p in plans for s in p.seqs][:4] == [
        (0, 16, False), (16, 16, False), (32, 8, True), (40, 1, True)]
    assert a.output_token_ids == reference(prompt, 3)


def test_budget_is_shared_between_decodes_and_chunks():
    sched = make_sched(budget=10, max_num_seqs=3)
    rs = [req(f"r{i}", range(i, i + 13), max_tokens=6) for i in range(3)]
    for r in rs:
        sched.add_request(r)
    plans = drive(sched)
    assert max(p.num_tokens for p in plans) == 10
    first = plans[0].seqs
    assert [(s.request_id, s.num_new_tokens) for s in first] == [("r0", 10)]
    for r in rs:
        assert r.output_token_ids == reference(r.prompt_token_ids, 6)


def test_max_num_seqs_caps_the_batch():
    sched = make_sched(max_num_seqs=2)
    rs = [req(f"r{i}", [i] * 6, max_tokens=5) for i in range(6)]
    for r in rs:
        sched.add_request(r)
    plans = drive(sched)
    assert max(len(p.seqs) for p in plans) == 2
    for r in rs:
        assert r.output_token_ids == reference(r.prompt_token_ids, 5)


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_keeps_outputs_identical(caching):
    sched = make_sched(block_size=4, num_blocks=12, budget=32, caching=caching)   # 11 usable blocks
    rs = [req(f"r{i}", [i + 1] * 6 + list(range(4)), max_tokens=20) for i in range(4)]
    for r in rs:
        sched.add_request(r)
    seen_preempted = False
    runner = FakeRunner(sched)
    while sched.has_unfinished():
        step(sched, runner)
        seen_preempted |= any(r.status is RequestStatus.PREEMPTED for r in sched.waiting)
    assert sched.stats().num_preemptions > 0 and seen_preempted
    for r in rs:
        assert r.output_token_ids == reference(r.prompt_token_ids, 20)
        assert r.finish_reason is FinishReason.LENGTH
    assert sched.kv.pool.stats().num_used == 0


def test_preempted_request_resamples_only_at_the_end_of_its_tokens():
    sched = make_sched(block_size=4, num_blocks=8, budget=8, max_num_seqs=2)        # 7 usable
    a, b = req("a", range(1, 9), max_tokens=12), req("b", range(30, 38), max_tokens=12)
    sched.add_request(a)
    sched.add_request(b)
    runner = FakeRunner(sched)
    while sched.has_unfinished():
        plan, out = step(sched, runner)
        for s in plan.seqs:
            r = sched.get_request(s.request_id) or next(x for x in (a, b) if x.request_id == s.request_id)
            if not s.sample:
                assert s.context_len < r.num_tokens
    assert sched.num_preemptions > 0
    assert a.output_token_ids == reference(a.prompt_token_ids, 12)
    assert b.output_token_ids == reference(b.prompt_token_ids, 12)
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 0    # first admission only


def test_fcfs_head_blocks_later_requests():
    sched = make_sched(block_size=4, num_blocks=11, budget=64)      # 10 usable blocks
    a = req("a", range(24), max_tokens=8)                          # 6 blocks, 8 by the end
    b = req("b", range(50, 74), max_tokens=2)                      # needs 6: does not fit beside a
    c = req("c", [3, 2, 1], max_tokens=2)                          # fits, but must wait behind b
    for r in (a, b, c):
        sched.add_request(r)
    runner, admitted = FakeRunner(sched), []
    while sched.has_unfinished():
        plan, _ = step(sched, runner)
        admitted += [s.request_id for s in plan.seqs if s.start_pos == 0]
        if a.status is RequestStatus.RUNNING:
            assert c.status is RequestStatus.WAITING
    assert admitted == ["a", "b", "c"]
    assert sched.num_preemptions == 0


def test_abort_frees_blocks_whether_running_or_waiting():
    sched = make_sched(max_num_seqs=1)
    runner = FakeRunner(sched)
    a, b = req("a", range(10), max_tokens=50), req("b", range(10), max_tokens=50)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)
    assert sched.abort_request("b") is b and b.finish_reason is FinishReason.ABORT
    assert sched.abort_request("a") is a and a.status is RequestStatus.FINISHED
    assert sched.abort_request("a") is None and sched.abort_request("nope") is None
    assert sched.kv.pool.stats().num_used == 0 and not sched.has_unfinished()
    assert sorted(sched.schedule().finished_request_ids) == ["a", "b"]
    sched.kv.pool.check_integrity()


def test_abort_between_schedule_and_update():
    sched = make_sched()
    runner = FakeRunner(sched)
    a = req("a", range(10))
    sched.add_request(a)
    plan = sched.schedule()
    result = runner.execute(plan)
    sched.abort_request("a")
    assert sched.update_from_result(plan, result) == [] and a.num_output_tokens == 0
    sched.kv.pool.check_integrity()


def test_stop_conditions():
    prompt = list(range(1, 9))
    ref = reference(prompt, 30)
    eos = ref[4]
    k = ref.index(eos)
    cases = [
        (req("eos", prompt, 30, eos=(eos,)), FinishReason.STOP, k + 1),
        (req("ign", prompt, 30, eos=(eos,), ignore_eos=True), FinishReason.LENGTH, 30),
        (req("stop", prompt, 30, stop_token_ids=(eos,)), FinishReason.STOP, k + 1),
        (req("max", prompt, 7), FinishReason.LENGTH, 7),
    ]
    sched = make_sched(max_num_seqs=4)
    for r, _, _ in cases:
        sched.add_request(r)
    drive(sched)
    for r, reason, n in cases:
        assert (r.finish_reason, r.num_output_tokens) == (reason, n), r.request_id
        assert r.output_token_ids == ref[:n]


def test_max_model_len_stops_with_length():
    sched = make_sched(max_model_len=20)
    a = req("a", range(15), max_tokens=100)
    sched.add_request(a)
    drive(sched)
    assert a.finish_reason is FinishReason.LENGTH and a.num_tokens == 20


def test_prompt_larger_than_pool_is_finished_not_looped():
    sched = make_sched(block_size=4, num_blocks=6)                 # 5 usable blocks = 20 tokens
    big, small = req("big", range(30)), req("small", range(5), max_tokens=2)
    sched.add_request(big)
    sched.add_request(small)
    runner = FakeRunner(sched)
    _, out = step(sched, runner)
    assert big in out and big.finish_reason is FinishReason.LENGTH and big.num_output_tokens == 0
    drive(sched, runner)
    assert small.output_token_ids == reference(small.prompt_token_ids, 2)


def test_decode_outgrowing_the_pool_finishes_with_length():
    sched = make_sched(block_size=4, num_blocks=4)                 # 3 usable blocks = 12 tokens
    a = req("a", range(8), max_tokens=100)
    sched.add_request(a)
    drive(sched)
    assert a.finish_reason is FinishReason.LENGTH and a.num_tokens == 13
    assert a.output_token_ids == reference(a.prompt_token_ids, 5)


def test_shared_system_prompt_reused_while_first_request_runs():
    sched = make_sched(block_size=4, budget=32, max_num_seqs=2)
    system = [7] * 30 + list(range(34))                             # 64 tokens = 16 blocks
    a = req("a", system + [1, 2, 3], max_tokens=4)
    sched.add_request(a)
    runner = FakeRunner(sched)
    step(sched, runner)                                             # a: tokens 0..31
    b = req("b", system + [9, 9], max_tokens=4)
    sched.add_request(b)
    step(sched, runner)                                             # a: tokens 32..63, budget spent
    assert b.status is RequestStatus.WAITING
    plan, _ = step(sched, runner)                                   # a: last 3, b admitted with a hit
    assert a.status is RequestStatus.RUNNING and b.num_cached_tokens == 64
    assert [(s.request_id, s.start_pos) for s in plan.seqs] == [("a", 64), ("b", 64)]
    drive(sched, runner)
    assert b.output_token_ids == reference(b.prompt_token_ids, 4)
    s = sched.stats()
    assert (s.prefix_cache_queries_tokens, s.prefix_cache_hits_tokens) == (67 + 66, 64)


def after_one_turn(prompt: list[int], max_tokens: int) -> tuple[Scheduler, FakeRunner, Request]:
    """A scheduler (blocks of 4) that has run request "a" on ``prompt`` to the end."""
    sched = make_sched(block_size=4)
    runner = FakeRunner(sched)
    a = req("a", prompt, max_tokens=max_tokens)
    sched.add_request(a)
    drive(sched, runner)
    return sched, runner, a


def test_next_turn_copies_the_prompt_tail_of_the_last_turns_block():
    # Turn 1: 10 prompt tokens (2 full blocks of 4 and 2 more) and 6 generated: block 2 holds the
    # prompt's last 2 tokens and 2 generated ones. Turn 2 continues the prompt with other tokens
    # (its history replaced the reply): 2 blocks hit by hash, 2 tokens copied from block 2.
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    sched, runner, a = after_one_turn(prompt, max_tokens=6)
    source = sched.kv.pool.get_cached_block(a.block_hashes[2])
    assert source is not None and source.ref_cnt == 0
    b = req("b", prompt + [40, 41, 42, 43, 44], max_tokens=5)
    sched.add_request(b)
    plan, _ = step(sched, runner)
    table = sched.kv.get_block_table(b)
    assert plan.block_copies == (BlockCopy(source.block_id, table[2], 2),)
    assert b.num_cached_tokens == 10 and [s.start_pos for s in plan.seqs] == [10]
    assert source.ref_cnt == 0                      # pinned for the step only
    drive(sched, runner)
    assert b.output_token_ids == reference(b.prompt_token_ids, 5)
    assert sched.stats().prefix_cache_hits_tokens == 10


def test_an_identical_prompt_computes_only_its_last_token():
    prompt = list(range(3, 17))                     # 14 tokens: 3 full blocks and 2
    sched, runner, _ = after_one_turn(prompt, max_tokens=4)
    b = req("b", prompt, max_tokens=4)
    sched.add_request(b)
    plan, _ = step(sched, runner)
    assert b.num_cached_tokens == 13 and plan.seqs[0].token_ids == [16]
    drive(sched, runner)
    assert b.output_token_ids == reference(prompt, 4)


def test_a_short_reply_leaves_its_partly_filled_block_to_the_next_turn():
    # Turn 1 ends inside the block after its prompt (10 prompt tokens, 1 reply token computed of
    # 2), so that block never fills or gets a hash; freed, it is listed with its 11 computed
    # tokens' last 3, and turn 2 (prompt, reply, more) copies them.
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    sched, runner, a = after_one_turn(prompt, max_tokens=2)
    b = req("b", prompt + a.output_token_ids + [50, 51], max_tokens=3)
    sched.add_request(b)
    plan, _ = step(sched, runner)
    assert [c.num_tokens for c in plan.block_copies] == [3] and b.num_cached_tokens == 11
    drive(sched, runner)
    assert b.output_token_ids == reference(b.prompt_token_ids, 3)


def test_a_preempted_request_copies_back_its_own_partial_block():
    sched = make_sched(block_size=4)
    runner = FakeRunner(sched)
    a = req("a", list(range(30, 40)), max_tokens=6)
    sched.add_request(a)
    step(sched, runner)                                        # the 10-token prompt, 1 sampled
    sched.preemption.preempt(a)
    plan, _ = step(sched, runner)
    assert [c.num_tokens for c in plan.block_copies] == [2] and plan.seqs[0].start_pos == 10
    drive(sched, runner)
    assert a.output_token_ids == reference(list(range(30, 40)), 6)


def test_a_partial_hit_whose_source_is_the_only_free_block_left_gives_way():
    # Block 3 of turn 1 is the copy source; turn 2 needs every free block, the source among them:
    # it is admitted without the partial hit (computing those tokens) instead of waiting forever.
    sched = make_sched(block_size=4, num_blocks=7)
    runner = FakeRunner(sched)
    prompt = list(range(20, 34))                    # 14 tokens; with 2 generated: 4 full blocks
    a = req("a", prompt, max_tokens=3)
    sched.add_request(a)
    drive(sched, runner)
    b = req("b", prompt + [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], max_tokens=1)    # 24 tokens: 6 blocks
    sched.add_request(b)
    assert len(sched.kv.get_computed_blocks(b).blocks) == 3 and sched.kv.copies.find(b, 3)[1] == 2
    plan, _ = step(sched, runner)
    assert plan.block_copies == () and b.num_cached_tokens == 12
    drive(sched, runner)
    assert b.output_token_ids == reference(b.prompt_token_ids, 1)


@pytest.mark.parametrize("seed", range(25))
def test_random_workloads_match_the_reference(seed):
    rng = random.Random(seed)
    bs = rng.choice([2, 4, 8])
    num_seqs = rng.randint(1, 5)
    sched = make_sched(block_size=bs, num_blocks=rng.randint(40 // bs + 2, 200 // bs), max_num_seqs=num_seqs,
                       budget=rng.randint(num_seqs, 40), caching=rng.random() < 0.8)
    shared = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 20))]
    rs = []
    for i in range(rng.randint(1, 10)):
        prompt = shared[:rng.randint(0, len(shared))] + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 15))]
        rs.append(req(f"r{i}", prompt, max_tokens=rng.randint(1, 20)))
    runner = FakeRunner(sched)
    pending = list(rs)
    while pending or sched.has_unfinished():
        for _ in range(rng.randint(0, 2)):
            if pending:
                sched.add_request(pending.pop(0))
        step(sched, runner)
    for r in rs:
        assert r.is_finished
        if r.finish_reason is FinishReason.LENGTH and r.num_output_tokens < r.sampling.max_tokens:
            continue                                                # outgrew a tiny pool
        assert r.output_token_ids == reference(r.prompt_token_ids, r.sampling.max_tokens)
    assert sched.kv.pool.stats().num_used == 0


class ScriptedConnector:
    """A connector scheduler half whose lookups answer from a script: ``answers[request_id]`` is
    a list of (tokens, is_async), one per call, the last one repeated."""

    def __init__(self, answers: dict[str, list[tuple[int | None, bool]]]) -> None:
        self.answers = answers
        self.lookups: list[str] = []
        self.finished: list[str] = []
        self.outputs: list[SchedulerOutput] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.lookups.append(request.request_id)
        script = self.answers.get(request.request_id, [(0, False)])
        return script.pop(0) if len(script) > 1 else script[0]

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMeta:
        self.outputs.append(scheduler_output)
        return ConnectorMeta()

    def request_finished(self, request, block_ids) -> bool:
        self.finished.append(request.request_id)
        return False


def test_pending_tier_lookup_holds_admission_while_running_requests_step():
    connector = ScriptedConnector({"late": [(None, False)] * 3 + [(0, False)]})
    sched = make_sched(connector=connector)
    runner = FakeRunner(sched)
    early = req("early", range(10), max_tokens=8)
    sched.add_request(early)
    step(sched, runner)
    late, behind = req("late", range(20, 30)), req("behind", range(40, 50))
    sched.add_request(late)
    sched.add_request(behind)
    for _ in range(3):                                  # the lookup of "late" is still running
        plan, out = step(sched, runner)
        assert [s.request_id for s in plan.seqs] == ["early"] and out == [early]
        assert late.status is RequestStatus.WAITING and behind.status is RequestStatus.WAITING
    plan, _ = step(sched, runner)                       # answered: "late", then "behind" (FCFS)
    assert [s.request_id for s in plan.seqs] == ["early", "late", "behind"]
    drive(sched, runner)
    for r in (early, late, behind):
        assert r.output_token_ids == reference(r.prompt_token_ids, r.sampling.max_tokens)
    assert sorted(connector.finished) == ["behind", "early", "late"]


def test_abort_while_loading_cancels_the_load_and_frees_blocks_when_it_reports():
    connector = ScriptedConnector({"slow": [(8, True)], "fast": [(8, True)]})
    sched = make_sched(connector=connector)
    slow, fast = req("slow", range(20)), req("fast", range(30, 50))
    sched.add_request(slow)
    sched.add_request(fast)
    sched.update_from_result(sched.schedule(), StepResult({}))
    assert slow.status is fast.status is RequestStatus.WAITING_FOR_KV
    assert sched.kv.pool.stats().num_used == 4             # two blocks each, held for the loads
    sched.abort_request("slow")
    sched.abort_request("fast")
    sched.finish_kv_transfers(FinishedTransfers(set(), {"fast": 2}))   # reported before any cancel
    assert sched.kv.pool.stats().num_used == 2             # "slow" keeps its blocks: still loading
    sched.update_from_result(sched.schedule(), StepResult({}))
    assert connector.outputs[-1].cancelled_loads == ("slow",)
    sched.finish_kv_transfers(FinishedTransfers(set(), {"slow": 1}))   # cut short after one block
    assert sched.kv.pool.stats().num_used == 0 and not sched.has_unfinished()
    sched.update_from_result(sched.schedule(), StepResult({}))
    assert connector.outputs[-1].cancelled_loads == ()
    assert sorted(connector.finished) == ["fast", "slow"]  # each told once
    sched.kv.pool.check_integrity()
