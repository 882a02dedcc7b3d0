"""Each request's draft length and shortest n-gram match, adapted to how many of its drafts the
target model accepts.

The acceptance rate is an exponentially weighted average of accepted / proposed over the steps that
verified drafts, starting at the rate its tenant's earlier requests reached (``AcceptancePriors``;
1 for a tenant not seen yet). The next draft is up to ``round(rate * max_len)`` tokens. When that
rounds to 0 the request stops drafting: it runs plain one-token steps and probes with a one-token
draft only after a wait that doubles with each probe (``FIRST_WAIT`` steps up to ``MAX_WAIT``),
so a request whose drafts are never accepted costs almost nothing. An accepted probe raises the
rate, and the length grows back.

Until a request's first accepted draft, each verified step that accepts nothing raises the
shortest suffix match that may draft by one (from the lookup's least length up to its most); the
first accepted draft sets it back to the least for the rest of the request. Short matches in free
text are mostly chance (a rejected draft from a 2-token match is the typical waste of an open
question), while a text that quotes soon matches long suffixes and accepts; lowering it for good
after an acceptance keeps the drafts of code edits and quotes that resume after a pause.

``chances(n)`` are the estimated probabilities that each of the next draft's first n tokens is
accepted (the j-th only if all before it are): per position, the drafts that reached it and the
drafts whose acceptance passed it, both decayed by ``CHANCE_DECAY`` a verified step. Counting per
position, not one rate per token, keeps what acceptance looks like: a draft is mostly accepted
whole or not at all, so a request whose drafts quote one time in four has a chance of 1/4 at every
position, not a chance that falls geometrically. Acceptance also comes in runs (a quote is accepted
draft after draft until the answer leaves it), so the request keeps two such tables: one for drafts
made right after a draft accepted whole (inside a run), one for the others, and ``chances`` reads
the one of the state the request is in. Both start from the starting rate, at most
``FIRST_CHANCE``, as one draft's worth of counts (the j-th position at that rate to the power j: a
new tenant's first drafts are not sized as sure things); a chance reads at most ``MAX_CHANCE``. The
step's draft sizing (``step_cost``) reads them.
"""

from __future__ import annotations

import math

# Weight of the latest step in the acceptance rate.
RATE_WEIGHT = 0.5
# Decode steps without a draft before the first probe, and the most ever waited between probes.
FIRST_WAIT = 8
MAX_WAIT = 512
# The weight the earlier verified steps keep in ``chances``.
CHANCE_DECAY = 0.75
# The most a request's chance per token starts at, and the most a position's chance reads.
FIRST_CHANCE = 0.9
MAX_CHANCE = 0.97


class DraftLength:
    """The adaptive draft length of one request (``max_len``: the configured most; ``rate``: the
    starting acceptance rate; ``min_match``..``max_match``: the n-gram lengths its drafts may use)."""

    def __init__(self, max_len: int, rate: float = 1.0, min_match: int = 1, max_match: int = 1) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"acceptance rate must be in [0, 1], got {rate}")
        self.max_len = max_len
        self.rate = rate
        self.min_match = min_match              # the shortest suffix match that may draft now
        self._least_match, self._most_match = min_match, max(min_match, max_match)
        self._accepted_any = False
        self._wait = 0              # plain steps left before the next probe
        self._next_wait = FIRST_WAIT
        start = min(rate, FIRST_CHANCE)
        # Per state (inside a run of drafts accepted whole, or not): per position, (reached, passed).
        self._counts = {state: ([1.0] * max_len, [start ** (j + 1) for j in range(max_len)])
                        for state in (True, False)}
        self._in_run = False

    def chances(self, n: int) -> list[float]:
        """The estimated chance that each of the next draft's first ``n`` tokens is accepted (never
        rising along the draft)."""
        reached, passed = self._counts[self._in_run]
        out, last = [], MAX_CHANCE
        for j in range(min(n, self.max_len)):
            last = min(last, passed[j] / reached[j])
            out.append(last)
        return out

    def next_length(self) -> int:
        """The most draft tokens this decode step may verify (0: a plain step); counts a plain step."""
        length = math.floor(self.rate * self.max_len + 0.5)
        if length > 0:
            self._next_wait = FIRST_WAIT
            return length
        if self._wait > 0:
            self._wait -= 1
            return 0
        self._wait, self._next_wait = self._next_wait, min(2 * self._next_wait, MAX_WAIT)
        return 1

    def record(self, num_proposed: int, num_accepted: int) -> None:
        """Fold one verified step into the rate and the shortest match: ``num_accepted`` of
        ``num_proposed`` drafts accepted."""
        if num_proposed <= 0:
            return
        self.rate += RATE_WEIGHT * (num_accepted / num_proposed - self.rate)
        reached, passed = self._counts[self._in_run]
        for j in range(self.max_len):
            reached[j] = CHANCE_DECAY * reached[j] + (j < num_proposed)
            passed[j] = CHANCE_DECAY * passed[j] + (j < num_accepted)
        self._in_run = num_accepted == num_proposed
        if num_accepted > 0 and not self._accepted_any:
            self._accepted_any = True
            self.min_match = self._least_match
        elif not self._accepted_any and self.min_match < self._most_match:
            self.min_match += 1
