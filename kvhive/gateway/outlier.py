"""Outlier ejection: a replica whose requests keep failing is taken out of routing for a while.

As Envoy's outlier detection (consecutive_5xx): ``consecutive_failures`` failed requests in a row
(a 5xx answer, a refused, reset or timed-out connection, an answer that is not HTTP or not the
JSON/SSE expected, a body cut mid-way) eject the replica for ``base_ejection_s`` times the number
of its ejections, at most ``max_ejection_s``. When that time is over it is routed to again on
probation: its next successful request returns it in full, its next failure ejects it again, for
longer. The count of ejections falls by one for each ``base_ejection_s`` the replica then serves
without being ejected, so a replica that failed once long ago starts again from the base time.
Which replicas are routed to while every one is ejected is the gateway's call (``Gateway.choose``
routes to all of them then, as Envoy's panic threshold does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The kinds of failed request, as counted in kvhive_gateway_upstream_failures_total{kind}.
FAILURE_KINDS = ("5xx", "connect", "connect_timeout", "reset", "timeout", "malformed", "cut")


@dataclass(frozen=True)
class OutlierPolicy:
    """When a replica is ejected and for how long (``consecutive_failures`` 0: never)."""

    consecutive_failures: int = 5
    base_ejection_s: float = 30.0
    max_ejection_s: float = 300.0

    def __post_init__(self) -> None:
        if not 0 <= self.consecutive_failures <= 10_000:
            raise ValueError("--outlier-consecutive-failures must be in [0, 10000] (0: no ejection), "
                             f"got {self.consecutive_failures}")
        if not (math.isfinite(self.base_ejection_s) and 0 < self.base_ejection_s <= 86400):
            raise ValueError(f"--outlier-base-ejection-s must be in (0, 86400], got {self.base_ejection_s}")
        if not (math.isfinite(self.max_ejection_s) and self.base_ejection_s <= self.max_ejection_s <= 86400):
            raise ValueError("--outlier-max-ejection-s must be in [--outlier-base-ejection-s, 86400], "
                             f"got {self.max_ejection_s}")

    @property
    def enabled(self) -> bool:
        """Whether failures eject replicas at all."""
        return self.consecutive_failures > 0

    def ejection_s(self, ejections: int) -> float:
        """How long the ``ejections``-th ejection in a row lasts."""
        return min(self.base_ejection_s * ejections, self.max_ejection_s)


class OutlierState:
    """One replica's failures in a row and ejections (changed on the event loop only; times are
    ``time.monotonic()`` seconds)."""

    def __init__(self) -> None:
        self.consecutive = 0                    # failed requests since the last success
        self.ejections = 0                      # ejections in a row (decays while it serves)
        self.ejected_until: float | None = None     # set from an ejection until a success after it
        self.served_since: float | None = None  # when it last came back from an ejection

    def ejected(self, now: float) -> bool:
        """Whether it is out of routing now."""
        return self.ejected_until is not None and now < self.ejected_until

    def on_probation(self, now: float) -> bool:
        """Whether its ejection time is over but no request has succeeded since."""
        return self.ejected_until is not None and now >= self.ejected_until

    def state(self, now: float) -> str:
        """"ejected", "probation" or "ok"."""
        return "ejected" if self.ejected(now) else "probation" if self.on_probation(now) else "ok"

    def succeeded(self, now: float) -> bool:
        """Count a successful request; True when it ended a probation (the replica is back)."""
        if self.ejected(now):
            return False                        # sent before the ejection: it decides nothing
        self.consecutive = 0
        if self.ejected_until is None:
            return False
        self.ejected_until, self.served_since = None, now
        return True

    def failed(self, now: float, policy: OutlierPolicy) -> float | None:
        """Count a failed request; the ejection's length in seconds when it ejects the replica now."""
        if not policy.enabled or self.ejected(now):
            return None
        self.consecutive += 1
        if not self.on_probation(now) and self.consecutive < policy.consecutive_failures:
            return None
        if not self.on_probation(now) and self.served_since is not None:
            served = int((now - self.served_since) // policy.base_ejection_s)
            self.ejections = max(0, self.ejections - served)
        self.ejections += 1
        self.consecutive = 0
        duration = policy.ejection_s(self.ejections)
        self.ejected_until = now + duration
        return duration
