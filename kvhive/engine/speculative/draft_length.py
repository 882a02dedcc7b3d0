"""Each request's draft length, adapted to how many of its drafts the target model accepts.

The acceptance rate is an exponentially weighted average of accepted / proposed over the steps that
verified drafts (starting at 1). The next draft is up to ``round(rate * max_len)`` tokens. When
that rounds to 0 the request stops drafting: it runs plain one-token steps and probes with a
one-token draft only after a wait that doubles with each probe (``FIRST_WAIT`` steps up to
``MAX_WAIT``), so a request whose drafts are never accepted costs almost nothing. An accepted
probe raises the rate, and the length grows back.
"""

from __future__ import annotations

import math

# Weight of the latest step in the acceptance rate.
RATE_WEIGHT = 0.5
# Decode steps without a draft before the first probe, and the most ever waited between probes.
FIRST_WAIT = 8
MAX_WAIT = 512


class DraftLength:
    """The adaptive draft length of one request (``max_len``: the configured most)."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.rate = 1.0
        self._wait = 0              # plain steps left before the next probe
        self._next_wait = FIRST_WAIT

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
        """Fold one verified step into the rate: ``num_accepted`` of ``num_proposed`` drafts accepted."""
        if num_proposed > 0:
            self.rate += RATE_WEIGHT * (num_accepted / num_proposed - self.rate)
