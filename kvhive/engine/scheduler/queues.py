"""The waiting queue and the running list every scheduler unit works on.

Invariants between steps: ``running`` is in admission order; admission takes the head of
``waiting``, or a request behind one passed over (a long prefill waiting for its place, a request
waiting for a block another computes). First come, first served (``--scheduling-policy fcfs``):
``waiting`` is in arrival order, and preemption puts a request back at the head. By priority (``priority``): ``waiting`` is sorted by (request ``priority``, arrival
time), lower first, equal keys in the order they were queued; a preempted request goes back to
its place in that order.
"""

from __future__ import annotations

import bisect
from collections import deque

from kvhive.request import Request, RequestStatus


class RequestQueues:
    """Unfinished requests by id, the waiting queue (FCFS or by priority) and the running list."""

    def __init__(self, by_priority: bool = False) -> None:
        self.by_priority = by_priority
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.by_id: dict[str, Request] = {}

    def add(self, request: Request) -> None:
        """Queue a new request at the back of ``waiting``; ValueError when its id is in use."""
        if request.request_id in self.by_id:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.status = RequestStatus.WAITING
        self.by_id[request.request_id] = request
        if self.by_priority:
            self._insert(request)
        else:
            self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take a request out of ``running`` or ``waiting`` (it stays in ``by_id``)."""
        if request.status in (RequestStatus.RUNNING, RequestStatus.WAITING_FOR_KV):
            self.running.remove(request)
        else:
            self.waiting.remove(request)

    def start(self, request: Request) -> Request:
        """Move a waiting request (the head, or one admitted past requests passed over) to the end
        of ``running``; its status is the caller's."""
        self.waiting.remove(request)
        self.running.append(request)
        return request

    def requeue_front(self, request: Request) -> None:
        """Move a running request back to the head of ``waiting`` (by priority: to its place)."""
        self.running.remove(request)
        if self.by_priority:
            self._insert(request, before_equals=True)
        else:
            self.waiting.appendleft(request)

    def _insert(self, request: Request, before_equals: bool = False) -> None:
        """Put a request in ``waiting`` by (priority, arrival): after the equal keys, or before them."""
        find = bisect.bisect_left if before_equals else bisect.bisect_right
        at = find(self.waiting, admission_key(request), key=admission_key)
        self.waiting.insert(at, request)

    def drop_finished(self) -> None:
        """Remove finished requests from ``running``, in place."""
        self.running[:] = [r for r in self.running if not r.is_finished]

    def preemption_key(self, request: Request) -> tuple:
        """Which running request gives way first: the largest key (by priority: the lowest
        priority, latest arrival; FCFS: the latest admitted, ``running``'s order)."""
        return admission_key(request) if self.by_priority else ()

    def num_computing(self) -> int:
        """Running requests that compute (not waiting for a KV load)."""
        return sum(1 for r in self.running if r.status is RequestStatus.RUNNING)


def admission_key(request: Request) -> tuple[int, float]:
    """Order of admission by priority: vLLM's, lower ``priority`` first, then earlier arrival."""
    return request.priority, request.arrival_time
