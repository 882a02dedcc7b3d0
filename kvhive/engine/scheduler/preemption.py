"""Preemption by recompute: when a running request cannot get blocks, the newest one gives way.

The victim is the newest running request still computing (the one asking, at worst); by priority
(``--scheduling-policy priority``), the one of the lowest priority (largest value), the newest
among those. A request waiting for a KV load keeps its blocks. It drops all its KV (its full blocks stay cached, so
re-admission mostly hits), keeps its output tokens, and goes back to the head of the waiting
queue (by priority: to its place in the queue's order).
"""

from __future__ import annotations

from kvhive.engine.scheduler.queues import RequestQueues
from kvhive.kv.manager import KVCacheManager
from kvhive.request import Request, RequestStatus


class Preemption:
    """Picks and preempts victims; counts preemptions."""

    def __init__(self, queues: RequestQueues, kv: KVCacheManager) -> None:
        self.queues = queues
        self.kv = kv
        self.num_preemptions = 0

    def pick_victim(self) -> Request:
        """The newest running request that is computing (not waiting for a KV load); by priority,
        the newest of the lowest priority."""
        computing = [r for r in reversed(self.queues.running) if r.status is RequestStatus.RUNNING]
        if not self.queues.by_priority:
            return computing[0]
        return max(computing, key=self.queues.preemption_key)

    def preempt(self, request: Request) -> None:
        """Free the request's blocks, reset it to recompute from token 0, requeue it at the head."""
        self.queues.requeue_front(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.num_preemptions += 1
