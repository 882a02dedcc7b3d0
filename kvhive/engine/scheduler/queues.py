"""The waiting queue and the running list every scheduler unit works on.

Invariants between steps: ``running`` is in arrival order, and every running request arrived
before every waiting one (admission takes the head of ``waiting``; preemption puts a request
back at the head).
"""

from __future__ import annotations

from collections import deque

from kvhive.request import Request, RequestStatus


class RequestQueues:
    """Unfinished requests by id, the FCFS waiting queue and the running list."""

    def __init__(self) -> None:
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.by_id: dict[str, Request] = {}

    def add(self, request: Request) -> None:
        """Queue a new request at the back of ``waiting``; ValueError when its id is in use."""
        if request.request_id in self.by_id:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.status = RequestStatus.WAITING
        self.by_id[request.request_id] = request
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take a request out of ``running`` or ``waiting`` (it stays in ``by_id``)."""
        if request.status in (RequestStatus.RUNNING, RequestStatus.WAITING_FOR_KV):
            self.running.remove(request)
        else:
            self.waiting.remove(request)

    def start_head(self) -> Request:
        """Move the head of ``waiting`` to the end of ``running``; its status is the caller's."""
        request = self.waiting.popleft()
        self.running.append(request)
        return request

    def requeue_front(self, request: Request) -> None:
        """Move a running request back to the head of ``waiting``."""
        self.running.remove(request)
        self.waiting.appendleft(request)

    def drop_finished(self) -> None:
        """Remove finished requests from ``running``, in place."""
        self.running[:] = [r for r in self.running if not r.is_finished]

    def num_computing(self) -> int:
        """Running requests that compute (not waiting for a KV load)."""
        return sum(1 for r in self.running if r.status is RequestStatus.RUNNING)
