"""Each tenant's acceptance prior: the rate a new request of the tenant starts drafting at.

A tenant is a request's prefix-cache salt, as the history store keys them (None: the anonymous
tenant). When a request that verified drafts finishes, its accepted and proposed draft tokens are
folded into its tenant's two decayed sums (``PRIOR_DECAY`` per request, so a request weighs by the
tokens it drafted and older requests fade); the prior is their ratio. A tenant not seen yet starts
at ``DEFAULT_PRIOR`` (1: draft at the full length at once, as quoting wants). Only a tenant's own
requests move its prior, so one tenant's workload never makes another's draft more or less.

The table keeps the ``max_tenants`` tenants updated most recently; the others start over from
``DEFAULT_PRIOR`` when they return. Torch-free.
"""

from __future__ import annotations

from collections import OrderedDict

DEFAULT_PRIOR = 1.0
# The weight an earlier request's sums keep when a later request of the tenant is folded in.
PRIOR_DECAY = 0.5
DEFAULT_MAX_TENANTS = 4096


class AcceptancePriors:
    """Per tenant, decayed sums of accepted and proposed draft tokens over its finished requests."""

    def __init__(self, max_tenants: int = DEFAULT_MAX_TENANTS) -> None:
        if max_tenants < 1:
            raise ValueError(f"max_tenants must be at least 1, got {max_tenants}")
        self.max_tenants = max_tenants
        self._sums: OrderedDict[str | None, tuple[float, float]] = OrderedDict()  # oldest update first

    def __len__(self) -> int:
        return len(self._sums)

    def prior(self, tenant: str | None) -> float:
        """The acceptance rate ``tenant``'s next request starts at."""
        sums = self._sums.get(tenant)
        return DEFAULT_PRIOR if sums is None else sums[0] / sums[1]

    def record(self, tenant: str | None, num_proposed: int, num_accepted: int) -> None:
        """Fold a finished request's draft tokens (``num_accepted`` of ``num_proposed`` accepted)
        into its tenant's prior; a request that verified none changes nothing."""
        if num_proposed <= 0:
            return
        if not 0 <= num_accepted <= num_proposed:
            raise ValueError(f"accepted ({num_accepted}) must be within 0..proposed ({num_proposed})")
        accepted, proposed = self._sums.pop(tenant, (0.0, 0.0))
        self._sums[tenant] = (PRIOR_DECAY * accepted + num_accepted, PRIOR_DECAY * proposed + num_proposed)
        while len(self._sums) > self.max_tenants:
            self._sums.popitem(last=False)
