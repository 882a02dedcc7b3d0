"""Preemption by recompute: the newest computing request gives way and goes back to the head."""

from __future__ import annotations

from support.scheduler_parts import compute, make_kv, make_request

from kvhive.engine.scheduler.preemption import Preemption
from kvhive.engine.scheduler.queues import RequestQueues
from kvhive.request import RequestStatus


def running_queues(kv, *requests):
    queues = RequestQueues()
    for r in requests:
        queues.add(r)
        queues.start(r)
        compute(kv, r, 6)
    return queues


def test_the_victim_is_the_newest_request_that_computes():
    kv = make_kv()
    old, new, loading = (make_request(n, range(i * 10, i * 10 + 8)) for i, n in enumerate(("old", "new", "loading")))
    queues = running_queues(kv, old, new, loading)
    loading.status = RequestStatus.WAITING_FOR_KV               # keeps its blocks for its load
    assert Preemption(queues, kv).pick_victim() is new


def test_preempt_frees_blocks_keeps_tokens_and_requeues_at_the_head():
    kv = make_kv()
    a, b = make_request("a", range(8)), make_request("b", range(20, 28))
    queues = running_queues(kv, a, b)
    later = make_request("later", range(40, 44))
    queues.add(later)
    b.append_output_token(5)
    preemption = Preemption(queues, kv)
    preemption.preempt(b)
    assert queues.running == [a] and list(queues.waiting) == [b, later]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.output_token_ids == [5] and kv.get_block_table(b) == []
    assert preemption.num_preemptions == 1
    # Its full block stays cached: re-admission finds it.
    assert kv.get_computed_blocks(b).num_computed_tokens == 4
    kv.pool.check_integrity()
