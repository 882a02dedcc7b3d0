"""Stop strings over streamed text: cut before the first match, hold back what could start one."""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Feeds text deltas and returns the part that is safe to send.

    Invariant: no stop string starts inside text already returned, because text that could be the
    start of a stop string is held in ``_pending`` until it either completes a match or cannot.
    """

    def __init__(self, stop_strings: Sequence[str], include_stop: bool = False) -> None:
        """``include_stop``: the text returned on a match ends with the stop string (vLLM's
        ``include_stop_str_in_output``); else it ends before it."""
        self._stops = tuple(s for s in stop_strings if s)
        self._include_stop = include_stop
        self._pending = ""
        self.stopped = False          # True once a stop string matched; nothing more is returned

    @property
    def has_stops(self) -> bool:
        """True when any stop string is looked for."""
        return bool(self._stops)

    def feed(self, delta: str) -> str:
        """Add generated text; return what can be sent now (text before a match, if one completed)."""
        if self.stopped:
            return ""
        if not self._stops:
            return delta
        self._pending += delta
        hits = [(i, len(s)) for i, s in ((self._pending.find(s), s) for s in self._stops) if i >= 0]
        if hits:
            self.stopped = True
            # The first match; at one place, the shortest stop (the one a stream completes first).
            start, length = min(hits)
            end = start + length if self._include_stop else start
            out, self._pending = self._pending[:end], ""
            return out
        keep = self._partial_match_len()
        cut = len(self._pending) - keep
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def flush(self) -> str:
        """Generation ended without a match: return the held-back text."""
        out, self._pending = self._pending, ""
        return "" if self.stopped else out

    def _partial_match_len(self) -> int:
        """Length of the longest suffix of the pending text that is a proper prefix of a stop string."""
        longest = min(len(self._pending), max(len(s) for s in self._stops) - 1)
        for k in range(longest, 0, -1):
            tail = self._pending[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0
