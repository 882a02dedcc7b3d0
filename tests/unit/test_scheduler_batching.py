"""Batching and admission: the token budget, decodes before chunks, FCFS admission, preemption and
spill when blocks run out, session resume, prefix hits and tier loads at admission."""

from __future__ import annotations

from support.scheduler_parts import compute, make_kv, make_request, park

from kvhive.config import SchedulerConfig
from kvhive.connector.base import ConnectorMeta
from kvhive.engine.scheduler.batching import Admission, Batcher, StepBudget
from kvhive.engine.scheduler.kv_transfers import KVTransfers
from kvhive.engine.scheduler.preemption import Preemption
from kvhive.engine.scheduler.queues import RequestQueues
from kvhive.engine.scheduler.session_spill import SessionCopy, SessionSpill
from kvhive.request import RequestStatus


class AsyncLoads:
    """A connector whose tiers hold ``num_tokens`` after any device hit, loaded asynchronously."""

    def __init__(self, num_tokens: int | None) -> None:
        self.num_tokens = num_tokens

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.num_tokens, True

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return ConnectorMeta()

    def request_finished(self, request, block_ids):
        return False


class Units:
    """The batching units wired as the Scheduler wires them, over a fresh KV manager."""

    def __init__(self, num_blocks=16, max_num_seqs=4, budget=64, session_copy=None, connector=None,
                 attention_context=None):
        self.kv = make_kv(num_blocks)
        self.queues = RequestQueues()
        self.too_long = []
        self.transfers = KVTransfers(connector, self.kv)
        self.spill = SessionSpill(self.kv, session_copy, self.transfers.pending_hashes)
        self.preemption = Preemption(self.queues, self.kv)
        self.batcher = Batcher(self.queues, self.kv, self.spill, self.preemption, self.too_long.append)
        config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
        self.admission = Admission(config, self.queues, self.kv, self.spill, self.transfers,
                                   self.too_long.append)
        self.budget = budget
        self.attention_context = attention_context

    def running(self, request, num_computed):
        """Put a request in ``running`` with ``num_computed`` tokens computed."""
        self.queues.add(request)
        self.queues.start(request)
        compute(self.kv, request, num_computed)
        return request

    def admit(self, *requests) -> StepBudget:
        for r in requests:
            self.queues.add(r)
        budget = StepBudget(self.budget, self.attention_context)
        self.admission.admit(budget)
        return budget


def decoding(rid, start):
    """A request with its 8-token prompt computed and one output token to feed back."""
    r = make_request(rid, range(start, start + 8))
    r.append_output_token(1)
    return r


def test_the_budget_gives_back_a_preempted_request_s_tokens():
    budget = StepBudget(10)
    budget.take("a", 4)
    budget.take("b", 3)
    budget.give_back("a")
    budget.give_back("never-planned")
    assert budget.tokens == 7 and budget.planned == {"b": 3}


def test_decodes_are_planned_before_prefill_chunks_and_chunks_take_what_is_left():
    units = Units(budget=6)
    prefill = units.running(make_request("prefill", range(20)), 8)
    units.running(decoding("decode", 50), 8)
    budget = StepBudget(6)
    assert not units.batcher.schedule_running(budget)
    assert budget.planned == {"decode": 1, "prefill": 5} and budget.tokens == 0
    assert len(units.kv.get_block_table(prefill)) == 4            # 13 tokens


def test_a_request_that_cannot_fit_even_alone_finishes_too_long():
    units = Units(num_blocks=4)                                   # 3 usable blocks: 12 tokens
    r = make_request("r", range(12))
    r.append_output_token(1)                                      # the 13th token needs a 4th block
    units.running(r, 12)
    assert not units.batcher.schedule_running(StepBudget(64))
    assert units.too_long == [r] and units.queues.running == []


def test_short_of_blocks_the_newest_running_request_is_preempted():
    units = Units(num_blocks=5)                                   # 4 usable blocks, all held
    old, new = units.running(decoding("old", 0), 8), units.running(decoding("new", 50), 8)
    budget = StepBudget(64)
    assert units.batcher.schedule_running(budget)
    assert budget.planned == {"old": 1} and list(units.queues.waiting) == [new]
    assert new.status is RequestStatus.PREEMPTED and units.preemption.num_preemptions == 1
    assert old.status is RequestStatus.RUNNING


def test_an_idle_session_with_a_copy_below_is_spilled_before_anything_is_preempted():
    units = Units(num_blocks=5, session_copy=lambda hashes: SessionCopy.LOWEST)
    park(units.kv, "idle", range(100, 108))
    units.running(decoding("a", 0), 8)
    budget = StepBudget(64)
    assert not units.batcher.schedule_running(budget)
    assert budget.planned == {"a": 1} and units.spill.num_spills == 1
    assert units.preemption.num_preemptions == 0


def test_admission_is_fcfs_and_the_head_that_does_not_fit_holds_the_rest():
    units = Units(num_blocks=6)                                   # 5 usable blocks
    units.running(make_request("running", range(8)), 8)
    big, small = make_request("big", range(20, 36)), make_request("small", range(40, 44))
    budget = units.admit(big, small)
    assert budget.planned == {} and list(units.queues.waiting) == [big, small]


def test_admission_stops_at_max_num_seqs_and_at_the_end_of_the_budget():
    units = Units(max_num_seqs=2)
    assert units.admit(*(make_request(f"r{i}", range(i * 10, i * 10 + 4)) for i in range(3))).planned \
        == {"r0": 4, "r1": 4}
    units = Units(budget=6)
    budget = units.admit(make_request("long", range(10)), make_request("next", range(20, 24)))
    assert budget.planned == {"long": 6} and [r.request_id for r in units.queues.waiting] == ["next"]


def test_a_prompt_longer_than_the_pool_finishes_and_the_next_is_admitted():
    units = Units(num_blocks=4)                                   # 3 usable blocks: 12 tokens
    huge, fits = make_request("huge", range(16)), make_request("fits", range(20, 24))
    assert units.admit(huge, fits).planned == {"fits": 4} and units.too_long == [huge]


def test_prefix_hits_are_computed_tokens_unless_prompt_logprobs_need_every_row():
    units = Units()
    done = units.running(make_request("done", range(8)), 8)
    units.queues.running.remove(done)
    units.kv.free(done)                                           # its two full blocks stay cached
    hit = make_request("hit", [*range(8), 90, 91])
    rows = make_request("rows", [*range(8), 92, 93], prompt_logprobs=1)
    assert units.admit(hit, rows).planned == {"hit": 2, "rows": 10}
    assert hit.num_computed_tokens == hit.num_cached_tokens == 8
    assert rows.num_computed_tokens == rows.num_cached_tokens == 0


def test_a_block_another_prefill_is_computing_is_waited_for_not_computed_twice():
    units = Units()
    units.running(make_request("first", range(12)), 4)            # blocks 1 and 2 in flight
    follower = make_request("follower", [*range(12), 7])
    assert units.admit(follower).planned == {} and follower.status is RequestStatus.WAITING


def test_a_session_turn_resumes_its_held_blocks():
    units = Units()
    park(units.kv, "s", range(8))
    turn = make_request("turn", [*range(8), 1, 2, 3], session_id="s")
    assert units.admit(turn).planned == {"turn": 3}
    assert turn.num_cached_tokens == 8 and units.kv.sessions.get("s") is None


def test_an_async_tier_load_parks_the_request_without_budget_and_a_pending_lookup_holds_the_queue():
    units = Units(connector=AsyncLoads(8))
    r = make_request("r", range(12))
    assert units.admit(r).planned == {} and r.status is RequestStatus.WAITING_FOR_KV
    assert units.transfers.loading == {"r": r} and units.queues.running == [r]
    units = Units(connector=AsyncLoads(None))
    assert units.admit(make_request("looking", range(12))).planned == {}
    assert len(units.queues.waiting) == 1


def test_without_an_attention_context_every_token_counts_one():
    budget = StepBudget(10)
    assert budget.cost(5000, 4) == 4 and budget.fit(5000, 30) == 10


def test_with_an_attention_context_a_token_at_position_p_counts_one_plus_p_over_it():
    budget = StepBudget(41, attention_context=100)
    assert budget.cost(0, 10) == 10 + 1                           # positions 0..9: 45 / 100, rounded up
    assert budget.cost(300, 10) == 10 + 31                        # positions 300..309: 3,045 / 100
    assert budget.fit(300, 100) == 10 and budget.fit(0, 100) == 35        # 35 + 595 / 100 = 41
    for start in (0, 7, 300):                                     # fit: the longest chunk that fits
        n = budget.fit(start, 100)
        assert budget.cost(start, n) <= 41 < budget.cost(start, n + 1)


def test_a_step_plans_at_least_one_token_however_long_the_context():
    budget = StepBudget(2, attention_context=1)
    assert budget.fit(1000, 50) == 1
    budget.take("a", 1, 1000)
    assert budget.tokens < 0 and budget.fit(1000, 50) == 0


def test_a_preempted_request_gives_back_the_work_it_was_charged():
    budget = StepBudget(100, attention_context=10)
    budget.take("a", 5, 40)
    budget.give_back("a")
    assert budget.tokens == 100 and budget.planned == {}


def test_long_context_chunks_take_more_of_the_budget_so_fewer_run_in_one_step():
    plain, weighted = Units(num_blocks=40), Units(num_blocks=40)
    for units in (plain, weighted):
        for rid in ("a", "b"):
            units.running(make_request(rid, range(ord(rid) * 100, ord(rid) * 100 + 40)), 32)
    budget = StepBudget(20)
    plain.batcher.schedule_running(budget)
    assert budget.planned == {"a": 8, "b": 8}
    budget = StepBudget(20, attention_context=16)                 # 8 tokens from 32: 8 + 18 > 20
    weighted.batcher.schedule_running(budget)
    assert budget.planned == {"a": 6}


def test_admission_gives_a_long_context_turn_a_chunk_the_weighted_budget_covers():
    units = Units(budget=20, attention_context=16)
    park(units.kv, "s", range(32))
    turn, other = make_request("turn", [*range(32), *range(500, 508)], session_id="s"), make_request("o", range(4))
    assert units.admit(turn, other).planned == {"turn": 6, "o": 1}    # 19 of 20, then 1 at position 0
