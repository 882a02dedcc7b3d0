"""Session affinity: which replica holds each session (``x-session-id``, ``conversation_id``) and
each stored response (``previous_response_id``, ``/v1/responses/{id}``)."""

from __future__ import annotations

from collections import OrderedDict

SESSION_HEADER = "x-session-id"
# A replica names a response it stored in this header (kvhive.server.responses).
RESPONSE_ID_HEADER = "x-kvhive-response-id"


class SessionAffinity:
    """session or response id -> replica name, learned from answers that carry ``x-session-id`` or
    ``x-kvhive-response-id`` (bounded LRU; session and response ids never look alike)."""

    def __init__(self, max_sessions: int = 100_000) -> None:
        self.max_sessions = max_sessions
        # Least recently used first; the event loop is the only writer.
        self._replica_of: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._replica_of)

    def get(self, session_id: str) -> str | None:
        """The replica that last served ``session_id``, or None."""
        replica = self._replica_of.get(session_id)
        if replica is not None:
            self._replica_of.move_to_end(session_id)
        return replica

    def remember(self, session_id: str, replica: str) -> None:
        """Record that ``replica`` now holds ``session_id``."""
        self._replica_of[session_id] = replica
        self._replica_of.move_to_end(session_id)
        while len(self._replica_of) > self.max_sessions:
            self._replica_of.popitem(last=False)

    def forget(self, session_id: str) -> None:
        """Drop ``session_id`` (it was deleted)."""
        self._replica_of.pop(session_id, None)
