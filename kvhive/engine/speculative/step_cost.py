"""How many draft tokens a step verifies: as many as raise the step's tokens per second.

A draft token costs the step one more row of the forward pass whether it is accepted or not. While
a step is bound by reading the weights once (one request, a GPU) that row is nearly free and every
draft pays; once the batch alone makes the step compute-bound (eight requests on two CPU cores) a
row costs about what a whole token of another request does, and only drafts that are almost sure to
be accepted pay back. The per-request acceptance rate does not see the batch, so the step's drafts
are sized here, over all the requests in decode together:

- ``StepCost`` learns how long a step of N decode rows takes from the steps of decode rows the
  engine runs (plain or drafted; a prefill chunk's rows cost less each, since only its last row
  needs logits, and would make a draft row look cheap). Each token-count bucket keeps an
  exponentially weighted mean. A step is slowed by what else the host runs, never sped up, so a
  bucket's mean falls fast and rises slowly (``COST_WEIGHT_DOWN``, ``COST_WEIGHT_UP``), and a
  bucket's first step counts at most twice what the fit expected there. The cost around a step
  of N rows, which its drafts may take to M, is a straight line fitted by least squares over the
  buckets from N/2 to 2M rows, each weighing by its steps seen (up to ``MAX_BUCKET_WEIGHT``): a
  draft row's price is the line's slope, never below 0. Steps far above M are left out because
  the cost is not a line over every count: a one-request step priced by the line through
  eight-request steps of a hundred rows read a row as half a step and cut drafts that pay. A line, not a curve through each bucket, because the price is a
  difference of two noisy times: through bucket means one slow step at a small count, or a
  neighbour's mean that happened to read low, gave a flat stretch where a row looked free and
  every draft was kept in a compute-bound step;
- ``size_drafts`` takes the draft positions in order of the chance they are accepted (each
  request's chances per position, ``DraftLength.chances``, never rising along its draft) and keeps
  the number of them at which the expected tokens the step emits, over the step's expected
  seconds, is highest.

Before two token counts have been seen there is no line and every draft is kept; nor is anything
cut where a draft token needs a chance below ``MIN_CUT_CHANCE`` to pay for its row (one request on
a CPU), where a wrong cut, measured, lost more than the rows it saved.

The positions a cut draft leaves out are not verified, so their estimates would stay where they
were: a request whose drafts are all cut would not see its text start quoting, and one whose drafts
are cut after a few tokens (a document quoted at full acceptance) would keep that length however
sure the positions after it are. ``Probes`` lengthens such drafts by one token now and then: a step
adds ``PROBE_SHARE`` of its expected time to a credit, and while the credit covers one more draft
token's cost the request cut longest ago verifies the first position it was cut at. A probe that
is accepted emitted a token for one row and gives its cost back to the credit, so a text whose cut
positions are accepted is probed again soon and its drafts grow by what was verified; what probes
waste stays within about that share of the time. A request whose probe is rejected waits longer
for its next one (``PROBE_WAIT_FIRST`` cut steps, doubling to ``PROBE_WAIT_MAX``, and none again
once a probe is accepted or its draft is kept whole), so text that never quotes (open chat) stops
spending even that share, while the credit goes to the requests whose probes pay. On a
weight-bound step a probe is cheap and comes often; on a compute-bound one it comes rarely.
Torch-free.
"""

from __future__ import annotations

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
# Cut steps a request waits for its next probe after a rejected one, doubling per rejection up to
# the most (see the module's docstring).
PROBE_WAIT_FIRST = 16
PROBE_WAIT_MAX = 128
# Token counts up to this have a bucket each; above it buckets grow by about 4.4% (2**(1/16)).
EXACT_BUCKETS = 32
# The most a bucket weighs in the fitted line, in steps seen: the count a busy step runs at most
# often does not drown the others, which give the line its slope.
MAX_BUCKET_WEIGHT = 16


def _bucket(num_tokens: int) -> int:
    if num_tokens <= EXACT_BUCKETS:
        return num_tokens
    return EXACT_BUCKETS + int(16 * math.log2(num_tokens / EXACT_BUCKETS))


class StepCost:
    """The seconds a step of N decode rows takes, learned from the steps run."""

    def __init__(self) -> None:
        # bucket -> [mean tokens, mean seconds, steps seen]
        self._means: dict[int, list[float]] = {}

    def observe(self, num_tokens: int, seconds: float) -> None:
        """One step of ``num_tokens`` decode rows took ``seconds``."""
        if num_tokens <= 0 or not seconds > 0 or math.isinf(seconds):
            return
        key = _bucket(num_tokens)
        mean = self._means.get(key)
        if mean is None:
            expected = self.seconds(num_tokens)
            self._means[key] = [float(num_tokens), seconds if expected is None else min(seconds, 2 * expected), 1.0]
            return
        weight = COST_WEIGHT_DOWN if seconds < mean[1] else COST_WEIGHT_UP
        mean[0] += weight * (num_tokens - mean[0])
        mean[1] += weight * (seconds - mean[1])
        mean[2] = min(mean[2] + 1, MAX_BUCKET_WEIGHT)

    def line(self, num_tokens: int, most_tokens: int = 0) -> tuple[float, float] | None:
        """The expected seconds of a step of ``num_tokens`` rows and the seconds each row more
        adds there (None: fewer than two token counts seen). The line is fitted over the buckets
        the step may reach, widened by half: from ``num_tokens / 2`` to twice ``most_tokens`` (the
        most rows it may take, at least ``num_tokens``), or over all of them where fewer than two
        lie there."""
        points = list(self._means.values())          # one per bucket: distinct token counts
        if len(points) < 2:
            return None
        top = 2 * max(num_tokens, most_tokens)
        near = [p for p in points if num_tokens / 2 <= p[0] <= top]
        if len(near) < 2:
            near = points
        sw = sum(p[2] for p in near)
        mx = sum(p[2] * p[0] for p in near) / sw
        my = sum(p[2] * p[1] for p in near) / sw
        sxx = sum(p[2] * (p[0] - mx) ** 2 for p in near)
        slope = max(0.0, sum(p[2] * (p[0] - mx) * (p[1] - my) for p in near) / sxx) if sxx > 0 else 0.0
        # Never below half the fastest bucket: a line extended to few rows is not a saving.
        floor = 0.5 * min(p[1] for p in points)
        return max(my + slope * (num_tokens - mx), floor), slope

    def seconds(self, num_tokens: int) -> float | None:
        """The expected seconds of a step of ``num_tokens`` rows (None: no line yet)."""
        line = self.line(num_tokens)
        return None if line is None else line[0]


def size_drafts(drafts: Mapping[str, list[float]], plain_tokens: int, plain_outputs: int,
                cost: StepCost) -> dict[str, int]:
    """How many of its draft tokens each request keeps this step.

    ``drafts``: request id -> the chance each of its proposed draft tokens is accepted (one per
    token, never rising); ``plain_tokens``: the step's tokens without drafts (decodes and prefill
    chunks); ``plain_outputs``: the tokens it emits without drafts (one per decode). Every draft is
    kept while ``cost`` knows no line, and where a first draft token pays for its row at a chance
    below ``MIN_CUT_CHANCE`` (a weight-bound step: one request on a CPU): there a wrongly cut draft
    loses more than a wasted row costs, and a request's low chances are the noisiest (its cut drafts
    are not verified, so they would stay low)."""
    line = cost.line(plain_tokens, plain_tokens + sum(len(chances) for chances in drafts.values()))
    if line is None or plain_outputs * line[1] / line[0] < MIN_CUT_CHANCE:
        return {rid: len(chances) for rid, chances in drafts.items()}
    base, per_row = line
    positions = sorted(((chance, rid) for rid, chances in drafts.items() for chance in chances),
                       key=lambda p: -p[0])
    expected, best, best_k = float(plain_outputs), plain_outputs / base, 0
    for k, (chance, _) in enumerate(positions, 1):
        expected += chance
        rate = expected / (base + per_row * k)
        if rate > best:
            best, best_k = rate, k
    kept: dict[str, int] = dict.fromkeys(drafts, 0)
    for _, rid in positions[:best_k]:
        kept[rid] += 1
    return kept


class Probes:
    """Which requests whose drafts the sizing cut verify one draft token more anyway (the module's
    docstring)."""

    def __init__(self) -> None:
        self._credit = 0.0                       # seconds of probing earned and not yet spent
        self._cut_steps: dict[str, int] = {}     # per request cut: steps since its last uncut draft or probe
        self._wait: dict[str, int] = {}          # per request whose last probe was rejected: cut steps
                                                 # before its next one
        self._pending: dict[str, tuple[int, float]] = {}   # this step's probes: request id -> (the
                                                            # draft position probed, the row's price)

    def lapse(self) -> None:
        """A new step: probes not settled (never planned) lapse."""
        self._pending.clear()

    def pick(self, kept: Mapping[str, int], proposed: Mapping[str, int], plain_tokens: int,
             cost: StepCost) -> list[str]:
        """The requests of ``kept`` (request id -> draft tokens kept, from ``size_drafts``, of the
        ``proposed`` draft tokens) that verify one draft token more this step, longest cut first."""
        self.lapse()
        for rid, n in kept.items():
            if n >= proposed[rid]:
                self._cut_steps.pop(rid, None)
                self._wait.pop(rid, None)
            else:
                self._cut_steps[rid] = self._cut_steps.get(rid, 0) + 1
        due = (rid for rid, n in kept.items() if n < proposed[rid] and self._cut_steps[rid] >= self._wait.get(rid, 0))
        cut = sorted(due, key=lambda rid: -self._cut_steps[rid])
        rows = plain_tokens + sum(kept.values())
        line = cost.line(rows, rows + len(cut))
        if not cut or line is None:
            return []
        step, probe = line
        self._credit = min(self._credit + PROBE_SHARE * step, 2 * probe + PROBE_SHARE * step)
        picked = []
        for rid in cut:
            if self._credit < probe:
                break
            self._credit -= probe
            self._cut_steps[rid] = 0
            self._pending[rid] = (kept[rid], probe)
            picked.append(rid)
        return picked

    def settle(self, request_id: str, verified: int, accepted: int) -> None:
        """The step verified ``verified`` of ``request_id``'s draft tokens and accepted ``accepted``:
        a probe whose token was accepted (or never computed: the draft was cut shorter when planned)
        gives its cost back to the credit."""
        pending = self._pending.pop(request_id, None)
        if pending is None:
            return
        position, probe = pending
        if verified <= position:
            self._credit += probe
        elif accepted > position:
            self._credit += probe
            self._wait.pop(request_id, None)
        else:
            self._wait[request_id] = min(2 * self._wait.get(request_id, PROBE_WAIT_FIRST // 2), PROBE_WAIT_MAX)

    def forget(self, request_id: str) -> None:
        """A request finished."""
        self._cut_steps.pop(request_id, None)
        self._wait.pop(request_id, None)
        self._pending.pop(request_id, None)
