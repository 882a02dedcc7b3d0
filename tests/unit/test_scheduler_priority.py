"""``--scheduling-policy priority``: admission by (request priority, arrival), lower first; the
lowest priority gives way first under preemption; FCFS is unchanged."""

from __future__ import annotations

import pytest
from support.scheduler_parts import FakeRunner, drive, reference, req, step

from kvhive.config import CacheConfig, SchedulerConfig
from kvhive.core.blocks import root_hash
from kvhive.engine.scheduler import Scheduler
from kvhive.engine.scheduler.queues import RequestQueues


def sched_with(policy: str, num_blocks: int = 64, max_num_seqs: int = 1, budget: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                     max_model_len=10_000, scheduling_policy=policy),
                     CacheConfig(block_size=4, enable_prefix_caching=True), num_blocks, root_hash(0))


def prioritized(rid: str, priority: int, arrival: float, prompt=None, max_tokens: int = 2):
    r = req(rid, prompt or [ord(rid[0]) % 50 + 1] * 6, max_tokens=max_tokens)
    r.priority, r.arrival_time = priority, arrival
    return r


def admission_order(sched: Scheduler) -> list[str]:
    order, runner = [], FakeRunner(sched)
    while sched.has_unfinished():
        plan, _ = step(sched, runner)
        order += [s.request_id for s in plan.seqs if s.request_id not in order]
    return order


def test_priority_policy_admits_lower_priority_values_first_then_by_arrival():
    sched = sched_with("priority")
    for r in (prioritized("a", 5, 1.0), prioritized("b", 0, 2.0), prioritized("c", 5, 0.5),
              prioritized("d", -3, 3.0), prioritized("e", 0, 2.0)):
        sched.add_request(r)
    assert [r.request_id for r in sched.waiting] == ["d", "b", "e", "c", "a"]
    assert admission_order(sched) == ["d", "b", "e", "c", "a"]


def test_fcfs_admits_in_arrival_order():
    sched = sched_with("fcfs")
    for rid in "xyz":
        sched.add_request(req(rid, [1, 2, 3, 4, 5], max_tokens=2))
    assert admission_order(sched) == ["x", "y", "z"]


def test_a_preempted_request_goes_back_to_its_place_by_priority():
    queues = RequestQueues(by_priority=True)
    early, late = prioritized("a", 1, 1.0), prioritized("b", 1, 2.0)
    queues.add(late)
    queues.add(early)
    assert [r.request_id for r in queues.waiting] == ["a", "b"]
    queues.start(queues.waiting[0])
    queues.add(prioritized("c", 0, 5.0))
    queues.requeue_front(early)                         # preempted: before its equals, after priority 0
    assert [r.request_id for r in queues.waiting] == ["c", "a", "b"]


@pytest.mark.parametrize(("policy", "first_victim"), [("priority", "r0"), ("fcfs", "r2")])
def test_under_pressure_the_lowest_priority_gives_way_and_every_output_is_right(policy, first_victim):
    sched = sched_with(policy, num_blocks=9, max_num_seqs=3, budget=16)
    rs = [prioritized(f"r{i}", p if policy == "priority" else 0, float(i), list(range(10 * i + 1, 10 * i + 9)),
                      max_tokens=8) for i, p in enumerate((2, 0, 1))]
    victims = []
    preempt = sched.preemption.preempt
    sched.preemption.preempt = lambda r: (victims.append(r.request_id), preempt(r))
    runner = FakeRunner(sched)
    sched.add_request(rs[0])               # the lowest priority runs first, alone
    step(sched, runner)
    sched.add_request(rs[1])
    sched.add_request(rs[2])
    drive(sched, runner)
    assert victims[0] == first_victim      # FCFS: the newest admitted; by priority: the lowest
    for r in rs:
        assert r.output_token_ids == reference(r.prompt_token_ids, 8)


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="--scheduling-policy"):
        SchedulerConfig(scheduling_policy="lifo")
