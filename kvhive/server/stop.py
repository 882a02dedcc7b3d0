"""Stop strings over streamed text: cut before the first match, hold back what could start one."""

from __future__ import annotations

import functools
from collections.abc import Sequence


@functools.lru_cache(maxsize=256)
def _fallbacks(stop: str) -> tuple[int, ...]:
    """``f[q]``, for q in 0..len(stop)-1: where a match of ``stop[:q]`` falls back to when the next
    character is not ``stop[q]``: its longest proper border ``stop[:k]`` with ``stop[k] != stop[q]``
    (Knuth-Morris-Pratt's failure function, with borders that would fail on the same character
    skipped, so one character costs O(log len(stop)) fall-backs at most, not O(len(stop)))."""
    border = [0] * (len(stop) + 1)      # border[q]: longest proper border of stop[:q]
    k = 0
    for q in range(1, len(stop)):
        while k and stop[k] != stop[q]:
            k = border[k]
        if stop[k] == stop[q]:
            k += 1
        border[q + 1] = k
    f = [0] * len(stop)
    for q in range(1, len(stop)):
        k = border[q]
        f[q] = f[k] if stop[k] == stop[q] else k
    return tuple(f)


class StopStringMatcher:
    """Feeds text deltas and returns the part that is safe to send.

    Invariant: no stop string starts inside text already returned, because text that could be the
    start of a stop string is held in ``_pending`` until it either completes a match or cannot.

    Each stop string keeps how much of it the text's end matches (a Knuth-Morris-Pratt state), so a
    delta costs time linear in its length per stop string, however long the held-back text is.
    """

    def __init__(self, stop_strings: Sequence[str], include_stop: bool = False) -> None:
        """``include_stop``: the text returned on a match ends with the stop string (vLLM's
        ``include_stop_str_in_output``); else it ends before it."""
        self._stops = tuple(dict.fromkeys(s for s in stop_strings if s))
        self._fallbacks = [_fallbacks(s) for s in self._stops]
        self._matched = [0] * len(self._stops)    # per stop: its longest prefix the text ends with
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
        base = len(self._pending)
        self._pending += delta
        first = None                  # (start, length) of the first match: at one place, the shortest
        for i, stop in enumerate(self._stops):
            end = self._advance(i, stop, delta)
            if end >= 0:
                match = (base + end - len(stop), len(stop))
                first = match if first is None else min(first, match)
        if first is not None:
            self.stopped = True
            start, length = first
            out, self._pending = self._pending[:start + length if self._include_stop else start], ""
            return out
        keep = max(self._matched)
        cut = len(self._pending) - keep
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def flush(self) -> str:
        """Generation ended without a match: return the held-back text."""
        out, self._pending = self._pending, ""
        return "" if self.stopped else out

    def _advance(self, i: int, stop: str, delta: str) -> int:
        """Run stop ``i``'s state over ``delta``: the end offset in ``delta`` of its first complete
        match, else -1 (the state then holds its longest prefix the text ends with)."""
        q, fallback, n = self._matched[i], self._fallbacks[i], len(stop)
        pos = 0
        while pos < len(delta):
            if q == 0:                # nothing of it matched: skip to its first character's next place
                pos = delta.find(stop[0], pos)
                if pos < 0:
                    break
            c = delta[pos]
            while q and stop[q] != c:
                q = fallback[q]
            if stop[q] == c:
                q += 1
                if q == n:
                    self._matched[i] = q
                    return pos + 1
            pos += 1
        self._matched[i] = q
        return -1
