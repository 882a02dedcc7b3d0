"""Session affinity: which replica holds each session (``x-session-id``, ``conversation_id``) and
each stored response (``previous_response_id``, ``/v1/responses/{id}``), per tenant.

Replicas keep sessions and stored responses per owner (a digest of the caller's API key,
``kvhive.core.tenancy.key_owner``): another key's id is unknown to them. The gateway keys what it
learned the same way, by (owner, id), so a request is routed, and labelled, by what its own key
holds only: an id another key holds routes exactly as an id nobody holds.
"""

from __future__ import annotations

from collections import OrderedDict

SESSION_HEADER = "x-session-id"
# A replica names a response it stored in this header (kvhive.server.responses).
RESPONSE_ID_HEADER = "x-kvhive-response-id"


class SessionAffinity:
    """(owner, session or response id) -> replica name, learned from answers that carry
    ``x-session-id`` or ``x-kvhive-response-id`` (bounded LRU shared by all owners; session and
    response ids never look alike)."""

    def __init__(self, max_sessions: int = 100_000) -> None:
        self.max_sessions = max_sessions
        # Least recently used first; the event loop is the only writer.
        self._replica_of: OrderedDict[tuple[str, str], str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._replica_of)

    def get(self, owner: str, session_id: str) -> str | None:
        """The replica that last served ``owner``'s ``session_id``, or None (also when only
        another owner used that id)."""
        key = (owner, session_id)
        replica = self._replica_of.get(key)
        if replica is not None:
            self._replica_of.move_to_end(key)
        return replica

    def remember(self, owner: str, session_id: str, replica: str) -> None:
        """Record that ``replica`` holds ``owner``'s ``session_id``."""
        key = (owner, session_id)
        self._replica_of[key] = replica
        self._replica_of.move_to_end(key)
        while len(self._replica_of) > self.max_sessions:
            self._replica_of.popitem(last=False)

    def forget(self, owner: str, session_id: str) -> None:
        """Drop ``owner``'s ``session_id`` (it was deleted)."""
        self._replica_of.pop((owner, session_id), None)
