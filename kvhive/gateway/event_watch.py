"""Loud silence: a replica whose KV events never reach the gateway (an ``events=`` endpoint nobody
publishes on, e.g. a replica whose --kv-events connects instead of binding) is routed by load
alone; the gateway says so once in its log and in its /health.

Silent means: a request was routed to the replica at least ``silent_after_s`` ago and no message
has arrived on its events endpoint since the subscription started (or was started over, when the
replica went down or its publisher reconnected). Any request that stores a new block makes a
replica publish, so a working subscription hears from it within moments of its first request.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

# The states /health shows for a replica's events: nothing routed to it yet (or for less than the
# stated time), messages arrive, or a request was routed and nothing arrived since.
WAITING, RECEIVING, SILENT = "waiting", "receiving", "silent"


class EventSilence:
    """Watches one replica's events endpoint (changed on the event loop only; times are
    ``time.monotonic()`` seconds)."""

    def __init__(self, replica: str, endpoint: str, silent_after_s: float) -> None:
        self.replica = replica
        self.endpoint = endpoint
        self.silent_after_s = silent_after_s
        self.routed_at: float | None = None     # the first request routed while nothing was heard
        self.warned = False

    def routed(self, now: float, heard: bool) -> None:
        """A request was routed to the replica at ``now``."""
        if not heard and self.routed_at is None:
            self.routed_at = now

    def check(self, now: float, heard: bool) -> str:
        """The state now (``heard``: a message arrived since the subscription (re)started); logs one
        warning when the replica turns silent and one line when its events arrive after that."""
        if heard:
            if self.warned:
                logger.warning("replica %s: KV events from %s arrive now; KV-aware routing to it resumes",
                               self.replica, self.endpoint)
            self.routed_at, self.warned = None, False
            return RECEIVING
        if self.routed_at is None or now - self.routed_at < self.silent_after_s:
            return WAITING
        if not self.warned:
            self.warned = True
            logger.warning("replica %s: no KV event arrived from its events endpoint %s in %.0f s since a "
                           "request was routed to it; routing to it falls back to load (is the endpoint "
                           "right, and does the replica bind it with --kv-events?)",
                           self.replica, self.endpoint, now - self.routed_at)
        return SILENT
