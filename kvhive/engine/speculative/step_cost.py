"""How many draft tokens a step verifies: as many as raise the step's tokens per second.

A draft token costs the step one more row of the forward pass whether it is accepted or not. While
a step is bound by reading the weights once (one request, a GPU) that row is nearly free and every
draft pays; once the batch alone makes the step compute-bound (eight requests on two CPU cores) a
row costs about what a whole token of another request does, and only drafts that are almost sure to
be accepted pay back. The per-request acceptance rate does not see the batch, so the step's drafts
are sized here, over all the requests in decode together:

- ``StepCost`` learns how long a step of N tokens takes from the steps the engine runs (an
  exponentially weighted mean per token-count bucket, read through a non-decreasing piecewise
  linear curve over the buckets seen). A step is slowed by what else the host runs, never sped
  up, so a bucket's mean falls fast and rises slowly (``COST_WEIGHT_DOWN``, ``COST_WEIGHT_UP``),
  and a bucket's first step counts at most twice what the curve expected there: one stalled
  step does not make drafts look dear for long;
- ``size_drafts`` takes the draft positions in order of the chance they are accepted (each
  request's chances per position, ``DraftLength.chances``, never rising along its draft) and keeps
  the number of them at which the expected tokens the step emits, over the step's expected
  seconds, is highest.

Before two token counts have been seen there is no curve and every draft is kept; nor is anything
cut where a draft token needs a chance below ``MIN_CUT_CHANCE`` to pay for its row (one request on
a CPU), where a wrong cut, measured, lost more than the rows it saved.

A request whose drafts are cut verifies none, so its acceptance estimate would stay where it fell
while its text may start quoting. ``Probes`` gives such requests one draft token now and then: a
step adds ``PROBE_SHARE`` of its expected time to a credit, and while the credit covers one more
draft token's cost the request cut longest ago verifies one. On a weight-bound step a probe is
cheap and comes often; on a compute-bound one it comes rarely, and probing never costs more than
about that share of the time. Torch-free.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping

# Weight of the latest step in its bucket's means: when it took less than the mean, and when more.
COST_WEIGHT_DOWN = 0.3
COST_WEIGHT_UP = 0.05
# Drafts are cut only where a draft token must be accepted at least this often to pay for its row
# (see ``size_drafts``).
MIN_CUT_CHANCE = 0.5
# The share of a step's expected time spent on probes (see the module's docstring).
PROBE_SHARE = 0.05
# Token counts up to this have a bucket each; above it buckets grow by about 4.4% (2**(1/16)).
EXACT_BUCKETS = 32


def _bucket(num_tokens: int) -> int:
    if num_tokens <= EXACT_BUCKETS:
        return num_tokens
    return EXACT_BUCKETS + int(16 * math.log2(num_tokens / EXACT_BUCKETS))


class StepCost:
    """The seconds a step of N tokens takes, learned from the steps run."""

    def __init__(self) -> None:
        self._means: dict[int, tuple[float, float]] = {}     # bucket -> (mean tokens, mean seconds)
        self._curve: tuple[list[float], list[float]] | None = None

    def observe(self, num_tokens: int, seconds: float) -> None:
        """One step of ``num_tokens`` tokens took ``seconds``."""
        if num_tokens <= 0 or not seconds > 0 or math.isinf(seconds):
            return
        key = _bucket(num_tokens)
        mean = self._means.get(key)
        if mean is None:
            expected = self.seconds(num_tokens)
            self._means[key] = (float(num_tokens), seconds if expected is None else min(seconds, 2 * expected))
        else:
            weight = COST_WEIGHT_DOWN if seconds < mean[1] else COST_WEIGHT_UP
            self._means[key] = (mean[0] + weight * (num_tokens - mean[0]), mean[1] + weight * (seconds - mean[1]))
        self._curve = None

    def seconds(self, num_tokens: int) -> float | None:
        """The expected seconds of a step of ``num_tokens`` tokens (None: fewer than two token
        counts seen). Between buckets the curve is linear; past the ends it goes on with the
        nearest segment's slope; it never falls as tokens grow."""
        curve = self._curve or self._build()
        if curve is None:
            return None
        xs, ys = curve
        i = min(max(bisect.bisect_left(xs, num_tokens), 1), len(xs) - 1)
        slope = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])
        return max(ys[i - 1] + slope * (num_tokens - xs[i - 1]), ys[0] * 0.5)

    def _build(self) -> tuple[list[float], list[float]] | None:
        points = sorted(self._means.values())
        if len(points) < 2:
            return None
        xs, ys = [], []
        for x, y in points:
            if xs and x - xs[-1] < 0.5:            # two buckets' means met: keep the later one
                xs.pop(), ys.pop()
            xs.append(x)
            ys.append(max(y, ys[-1]) if ys else y)  # non-decreasing: a noisy dip is not a saving
        if len(xs) < 2:
            return None
        self._curve = (xs, ys)
        return self._curve


def size_drafts(drafts: Mapping[str, list[float]], plain_tokens: int, plain_outputs: int,
                cost: StepCost) -> dict[str, int]:
    """How many of its draft tokens each request keeps this step.

    ``drafts``: request id -> the chance each of its proposed draft tokens is accepted (one per
    token, never rising); ``plain_tokens``: the step's tokens without drafts (decodes and prefill
    chunks); ``plain_outputs``: the tokens it emits without drafts (one per decode). Every draft is
    kept while ``cost`` knows no curve, and where a first draft token pays for its row at a chance
    below ``MIN_CUT_CHANCE`` (a weight-bound step: one request on a CPU): there a wrongly cut draft
    loses more than a wasted row costs, and a request's low chances are the noisiest (its cut drafts
    are not verified, so they would stay low)."""
    base = cost.seconds(plain_tokens)
    if base is None or plain_outputs * (cost.seconds(plain_tokens + 1) - base) / base < MIN_CUT_CHANCE:
        return {rid: len(chances) for rid, chances in drafts.items()}
    positions = sorted(((chance, rid) for rid, chances in drafts.items() for chance in chances),
                       key=lambda p: -p[0])
    expected, best, best_k = float(plain_outputs), plain_outputs / base, 0
    for k, (chance, _) in enumerate(positions, 1):
        expected += chance
        rate = expected / cost.seconds(plain_tokens + k)
        if rate > best:
            best, best_k = rate, k
    kept: dict[str, int] = dict.fromkeys(drafts, 0)
    for _, rid in positions[:best_k]:
        kept[rid] += 1
    return kept


class Probes:
    """Which requests whose drafts the sizing cut verify one draft token anyway (the module's
    docstring)."""

    def __init__(self) -> None:
        self._credit = 0.0                       # seconds of probing earned and not yet spent
        self._cut_steps: dict[str, int] = {}     # per request cut: steps since its last draft or probe

    def pick(self, kept: dict[str, int], plain_tokens: int, cost: StepCost) -> list[str]:
        """The requests of ``kept`` (request id -> draft tokens kept, from ``size_drafts``) with none
        kept that verify one draft token this step, longest cut first."""
        for rid, n in kept.items():
            if n > 0:
                self._cut_steps.pop(rid, None)
            else:
                self._cut_steps[rid] = self._cut_steps.get(rid, 0) + 1
        cut = sorted((rid for rid, n in kept.items() if n == 0), key=lambda rid: -self._cut_steps[rid])
        tokens = plain_tokens + sum(kept.values())
        step = cost.seconds(tokens)
        if not cut or step is None:
            return []
        probe = cost.seconds(tokens + 1) - step
        self._credit = min(self._credit + PROBE_SHARE * step, 2 * probe + PROBE_SHARE * step)
        picked = []
        for rid in cut:
            if self._credit < probe:
                break
            self._credit -= probe
            self._cut_steps[rid] = 0
            picked.append(rid)
        return picked

    def forget(self, request_id: str) -> None:
        """A request finished."""
        self._cut_steps.pop(request_id, None)
