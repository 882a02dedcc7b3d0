"""Draft sizing by the step's measured cost: the step-cost curve, the choice of draft tokens against
a brute force over every choice, the per-token acceptance estimate, and the scheduler's drafted
steps under a weight-bound and a compute-bound cost (with the probe of a request whose drafts are
cut)."""

from __future__ import annotations

import itertools
import random

import pytest

from kvhive.config import CacheConfig, SchedulerConfig
from kvhive.core.blocks import root_hash
from kvhive.core.speculative_config import SpeculativeConfig
from kvhive.engine.scheduler import Scheduler
from kvhive.engine.speculative.draft_length import MAX_CHANCE, DraftLength
from kvhive.engine.speculative.step_cost import (
    MIN_CUT_CHANCE,
    PROBE_SHARE,
    PROBE_WAIT_FIRST,
    PROBE_WAIT_MAX,
    Probes,
    StepCost,
    size_drafts,
)
from kvhive.engine.step import ScheduledSeq, StepPlan, StepResult
from kvhive.request import Request, SamplingParams


def linear_cost(fixed: float, per_token: float, counts=(1, 8, 16, 48)) -> StepCost:
    cost = StepCost()
    for n in counts:
        cost.observe(n, fixed + per_token * n)
    return cost


def geo(n: int, chance: float) -> list[float]:
    """The chances of n draft tokens each accepted with ``chance`` once those before it were."""
    return [chance ** j for j in range(1, n + 1)]


def test_the_line_needs_two_token_counts_then_fits_the_steps() -> None:
    cost = StepCost()
    assert cost.seconds(4) is None and cost.line(4) is None
    cost.observe(8, 0.040)
    cost.observe(8, 0.040)
    assert cost.seconds(8) is None                      # one token count: no slope yet
    cost.observe(16, 0.060)
    assert cost.line(8) == pytest.approx((0.040, 0.0025))
    assert cost.seconds(12) == pytest.approx(0.050)
    assert cost.seconds(24) == pytest.approx(0.080)     # past the last bucket: the slope goes on
    assert cost.seconds(1) == pytest.approx(0.0225)     # below the first: likewise
    steep = StepCost()
    steep.observe(10, 0.010)
    steep.observe(20, 0.100)
    assert steep.seconds(1) == pytest.approx(0.005)     # never below half the smallest bucket's time


def test_a_rows_price_is_the_slope_of_the_steps_around_it_not_one_noisy_bucket() -> None:
    # Measured over HTTP at eight requests (float32, 2 cores): steps of n decode rows take about
    # 6 + 2 ms a row, one-token steps 10 ms, and one two-token step stalled at 25 ms. Through the
    # bucket means, made non-decreasing, that stall flattened the curve past eight rows and a draft
    # row looked free (0.2 ms), so every draft was kept.
    cost = StepCost()
    for n, seconds in ((1, 0.010), (1, 0.010), (2, 0.025), (5, 0.017), (6, 0.0175), (7, 0.0206)):
        cost.observe(n, seconds)
    for _ in range(30):
        cost.observe(8, 0.022)
    cost.observe(9, 0.0215)                             # the first drafted step read low
    for n in (10, 12, 14, 19):
        cost.observe(n, 0.006 + 0.002 * n)
    base, per_row = cost.line(8)
    assert base == pytest.approx(0.022, rel=0.05)
    assert per_row == pytest.approx(0.002, rel=0.25)
    # So eight requests' drafts accepted one time in two do not pay for their rows.
    assert size_drafts({f"r{i}": [0.5] for i in range(8)}, 8, 8, cost) == {f"r{i}": 0 for i in range(8)}


def test_the_line_never_falls_and_follows_recent_steps() -> None:
    cost = StepCost()
    cost.observe(4, 0.020)
    cost.observe(8, 0.015)                              # a noisy dip: not a saving
    assert cost.line(8) == pytest.approx((0.0175, 0.0))
    cost.observe(16, 0.040)
    cost.observe(16, 0.400)                             # one stalled step barely moves it
    assert cost.seconds(16) < 0.060
    for _ in range(100):                                # the host got slower: the mean follows
        cost.observe(16, 0.080)
    assert cost._means[16][1] == pytest.approx(0.080, rel=0.02)
    for _ in range(10):                                 # and faster again, sooner
        cost.observe(16, 0.040)
    assert cost._means[16][1] == pytest.approx(0.040, rel=0.05)


def test_a_buckets_first_step_counts_at_most_twice_what_the_line_expected() -> None:
    cost = linear_cost(0.008, 0.0026, counts=(1, 8))
    cost.observe(6, 1.0)                                # a stall on the first step of 6 tokens
    assert cost._means[6][1] == pytest.approx(2 * (0.008 + 0.0026 * 6))


def test_wide_token_counts_share_buckets() -> None:
    cost = StepCost()
    for n in (600, 603, 606, 1, 2):
        cost.observe(n, n / 1000)
    assert len(cost._means) == 3                        # 600..606 are one bucket above 32
    assert cost.seconds(603) == pytest.approx(0.603, rel=0.01)


def test_no_curve_keeps_every_draft() -> None:
    assert size_drafts({"a": geo(5, 0.1), "b": geo(3, 0.9)}, 2, 2, StepCost()) == {"a": 5, "b": 3}


def test_a_weight_bound_step_keeps_every_draft() -> None:
    flat = linear_cost(0.011, 0.0001)
    assert size_drafts({"a": geo(5, 0.9), "b": geo(5, 0.1)}, 2, 2, flat) == {"a": 5, "b": 5}
    one_request = linear_cost(0.010, 0.0015)        # a row costs 15% of the step: a chance of 0.15 pays
    assert size_drafts({"a": geo(12, 0.5)}, 1, 1, one_request) == {"a": 12}


def test_a_compute_bound_step_keeps_only_likely_drafts() -> None:
    # Eight decodes at 8 + 2.6 ms a token (the 2-core host in float32): a token each at 3.6 ms.
    steep = linear_cost(0.008, 0.0026)
    drafts = {f"q{i}": geo(5, 0.97) for i in range(4)} | {f"c{i}": geo(5, 0.5) for i in range(4)}
    kept = size_drafts(drafts, 8, 8, steep)
    assert all(kept[f"c{i}"] == 0 for i in range(4))
    assert all(kept[f"q{i}"] >= 3 for i in range(4))
    assert size_drafts({f"c{i}": geo(5, 0.6) for i in range(8)}, 8, 8, steep) == {f"c{i}": 0 for i in range(8)}


def test_a_small_step_is_priced_by_the_steps_near_it_not_by_far_larger_ones() -> None:
    # One request: a step of 1 row takes 10 ms and each draft row 1.5 ms more. Eight requests with
    # long drafts ran steps of 40 to 100 rows, dearer a row each (long contexts). A line through
    # all of them reads a 1-row step as near nothing and a row as half of it, and would cut a
    # lone request's drafts; the buckets the step may reach price it as it runs.
    cost = StepCost()
    for _ in range(16):
        for n in range(1, 14):
            cost.observe(n, 0.010 + 0.0015 * (n - 1))
        for n in (40, 48, 56, 64, 80, 100):
            cost.observe(n, 0.060 + 0.004 * (n - 40))
    base, per_row = cost.line(1, 13)
    assert base == pytest.approx(0.010, rel=0.05) and per_row == pytest.approx(0.0015, rel=0.05)
    assert size_drafts({"r": [0.3] * 12}, 1, 1, cost) == {"r": 12}       # a row at 0.15 of a step: kept
    far = cost.line(1, 200)                                             # steps that large: their slope
    assert far[1] > 0.0025


@pytest.mark.parametrize("seed", range(80))
def test_the_kept_drafts_give_the_best_expected_rate_of_any_choice(seed: int) -> None:
    rng = random.Random(seed)
    cost = StepCost()
    for n in sorted(rng.sample(range(1, 40), rng.randint(2, 6))):    # odd curves, or compute-bound ones
        cost.observe(n, rng.uniform(0.005, 0.2) if seed % 2 else rng.uniform(0.002, 0.004) * n + rng.uniform(0, 0.004))
    drafts = {f"r{i}": sorted((rng.random() for _ in range(rng.randint(1, 4))), reverse=True)
              for i in range(rng.randint(1, 3))}
    plain_outputs = len(drafts) + rng.randint(0, 2)
    plain_tokens = plain_outputs + (rng.randint(0, 10) if seed % 2 else 0)

    base, per_row = cost.line(plain_tokens, plain_tokens + sum(map(len, drafts.values())))

    def rate(counts: dict[str, int]) -> float:
        expected = plain_outputs + sum(sum(drafts[r][:n]) for r, n in counts.items())
        return expected / (base + per_row * sum(counts.values()))

    kept = size_drafts(drafts, plain_tokens, plain_outputs, cost)
    assert all(0 <= kept[r] <= len(drafts[r]) for r in drafts)
    if plain_outputs * per_row / base < MIN_CUT_CHANCE:
        assert kept == {r: len(c) for r, c in drafts.items()}          # cheap rows: nothing is cut
        return
    best = max(rate(dict(zip(drafts, counts, strict=True)))
               for counts in itertools.product(*(range(len(c) + 1) for c in drafts.values())))
    assert rate(kept) == pytest.approx(best)


def test_the_chances_are_counted_per_position() -> None:
    length = DraftLength(5, rate=1.0)
    assert length.chances(3) == pytest.approx([0.9, 0.81, 0.729])    # a new tenant's: not sure things
    assert DraftLength(5, rate=0.5).chances(2) == pytest.approx([0.5, 0.25])
    for _ in range(40):
        length.record(5, 2)         # two accepted, the third rejected
    assert length.chances(5) == pytest.approx([MAX_CHANCE, MAX_CHANCE, 0, 0, 0], abs=1e-4)
    assert len(length.chances(9)) == 5                              # never past the configured most
    quotes = DraftLength(4, rate=1.0)
    for _ in range(10):             # one draft in four is a quote accepted whole, the others nothing
        for accepted in (0, 0, 0):
            quotes.record(4, accepted)
        quotes.record(4, 4)
        quotes.record(4, 0)         # made inside the run: the quote ended
    cold = quotes.chances(4)
    assert max(cold) - min(cold) < 0.01 and 0.1 < cold[0] < 0.5   # flat along the draft, not geometric


def test_the_chances_inside_a_run_of_accepted_drafts_are_their_own() -> None:
    """Free text between quotes (drafts rejected), then a quote (drafts accepted whole until it
    ends): drafts made inside a run are judged by runs, the others by the rest."""
    length = DraftLength(8, rate=1.0)
    for _ in range(20):
        for _ in range(3):
            length.record(8, 0)     # free text
        length.record(8, 8)         # the quote starts
        length.record(8, 8)
        length.record(8, 8)
        length.record(8, 2)         # and ends
        cold = length.chances(8)
    assert cold[0] < 0.4
    length.record(8, 0)
    length.record(8, 8)
    assert length.chances(8)[-1] > 0.5 > cold[0]        # inside a run: most runs went on


def scheduler(cost: StepCost | None) -> Scheduler:
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=10_000),
                      CacheConfig(block_size=4, enable_prefix_caching=True), 400, root_hash(0),
                      speculative=SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1,
                                                    prompt_lookup_max=3))
    if cost is not None:
        sched.speculation.cost = cost
    return sched


def decoding(sched: Scheduler, n: int) -> list[Request]:
    """``n`` requests in decode whose tokens repeat (each would draft its full length)."""
    requests = []
    for i in range(n):
        request = Request(f"r{i}", [20 + i] + [5, 6, 7, 8] * 4, SamplingParams(max_tokens=500))
        sched.add_request(request)
        requests.append(request)
    plan = sched.schedule()
    assert len(plan.seqs) == n and all(not s.draft_token_ids for s in plan.seqs)
    for request in requests:                       # prefilled: the next step decodes
        request.num_computed_tokens = request.num_tokens
        request.append_output_token(5)
    return requests


def drafted_counts(sched: Scheduler) -> dict[str, int]:
    sched.speculation.begin_step()
    plan = sched.schedule()
    counts = {s.request_id: len(s.draft_token_ids) for s in plan.seqs}
    for seq in plan.seqs:                           # undo the plan: the next call plans the same step
        sched.kv.trim_blocks(sched.queues.by_id[seq.request_id], seq.start_pos)
    return counts


def test_the_scheduler_drafts_fully_while_the_step_is_weight_bound() -> None:
    sched = scheduler(linear_cost(0.011, 0.0001))
    decoding(sched, 8)
    assert drafted_counts(sched) == {f"r{i}": 4 for i in range(8)}


def plan_of(*rows: tuple[int, int]) -> StepPlan:
    """A step of sequences computing (new tokens, of which drafts) each."""
    return StepPlan([ScheduledSeq(f"s{i}", [1] * new, 10, [0], True, SamplingParams(), draft_token_ids=(1,) * drafts)
                     for i, (new, drafts) in enumerate(rows)])


def test_the_default_sizing_learns_from_the_steps_observed() -> None:
    sched = scheduler(None)
    assert sched.speculation.cost is not None       # "step_cost" is the default
    for plan in (plan_of((1, 0)), plan_of(*[(1, 0)] * 8), plan_of(*[(2, 1)] * 8), plan_of(*[(6, 5)] * 8)):
        assert plan.decode_rows_only
        sched.observe_step(plan, 0.006 + 0.0025 * plan.num_tokens)
    assert sched.speculation.cost.line(16) == pytest.approx((0.046, 0.0025))
    per_request = Scheduler(SchedulerConfig(), CacheConfig(block_size=4), 16, root_hash(0),
                            speculative=SpeculativeConfig(num_speculative_tokens=2, draft_sizing="per_request"))
    assert per_request.speculation.cost is None
    per_request.observe_step(plan_of((1, 0)), 0.03)               # nothing to learn: no error


def test_steps_with_a_prefill_chunk_do_not_price_draft_rows() -> None:
    # Eight decodes take 31 ms; a 40-token prefill step 15 ms. Read into one non-decreasing curve,
    # the prefill step flattened it past eight tokens and a draft row looked free, so every draft
    # was kept in compute-bound steps. Only decode rows (plain or drafted) are learned.
    sched = scheduler(None)
    prefill, mixed = plan_of((40, 0)), plan_of(*[(1, 0)] * 7, (33, 0))
    assert not prefill.decode_rows_only and not mixed.decode_rows_only and not StepPlan([]).decode_rows_only
    for plan, seconds in ((plan_of(*[(1, 0)] * 4), 0.019), (plan_of(*[(1, 0)] * 8), 0.031),
                          (prefill, 0.015), (mixed, 0.016)):
        sched.observe_step(plan, seconds)
    cost = sched.speculation.cost
    assert cost.seconds(40) == pytest.approx(0.031 + 32 * 0.003)      # the decode rows' slope, extended
    assert cost.seconds(9) - cost.seconds(8) == pytest.approx(0.003)
    # Eight requests each drafting a token accepted one time in two: not worth a 3 ms row.
    assert size_drafts({f"r{i}": [0.5] for i in range(8)}, 8, 8, cost) == {f"r{i}": 0 for i in range(8)}


def test_a_compute_bound_step_cuts_unlikely_drafts_and_probes_them_now_and_then() -> None:
    sched = scheduler(linear_cost(0.008, 0.0026))
    requests = decoding(sched, 8)
    proposer = sched.speculation.proposer
    drafted_counts(sched)                           # the first drafts: each request's state exists now
    for request in requests:
        for _ in range(10):                                         # the first draft token: 1 in 2
            proposer.draft_length(request.request_id).record(4, 0)
            proposer.draft_length(request.request_id).record(4, 2)
    steps = 160
    probes = {f"r{i}": 0 for i in range(8)}
    for _ in range(steps):
        counts = drafted_counts(sched)
        assert set(counts.values()) <= {0, 1}
        for rid, n in counts.items():
            probes[rid] += n
    # A probe (2.6 ms) every 8 + 2.6 * 8 = 28.8 ms * PROBE_SHARE of credit: about one in two steps,
    # taken in turn, so each request probes about every 16 steps.
    expected = steps * PROBE_SHARE * 0.0288 / 0.0026
    assert sum(probes.values()) == pytest.approx(expected, abs=2)
    assert max(probes.values()) - min(probes.values()) <= 1
    sched.speculation.cost = linear_cost(0.011, 0.0001)             # the batch shrank: drafts pay again
    assert set(drafted_counts(sched).values()) == {1}             # its own length (rate 1/4 of 4), uncut


def quoting_steps(sched: Scheduler, steps: int) -> list[list[int]]:
    """Run ``steps`` steps of requests from ``decoding`` whose text goes on repeating 5 6 7 8: every
    draft is accepted. Per step, the draft tokens each request verified."""
    pattern = [5, 6, 7, 8]
    following = {t: pattern[(i + 1) % 4] for i, t in enumerate(pattern)}
    drafted = []
    for _ in range(steps):
        plan = sched.schedule()
        sampled, accepted = {}, {}
        for seq in plan.seqs:
            last = (seq.draft_token_ids or sched.queues.by_id[seq.request_id].all_token_ids)[-1]
            sampled[seq.request_id] = following[last]
            if seq.draft_token_ids:
                accepted[seq.request_id] = tuple(seq.draft_token_ids)
        drafted.append([len(s.draft_token_ids) for s in plan.seqs])
        sched.update_from_result(plan, StepResult(sampled, accepted_drafts=accepted))
    return drafted


def test_a_quote_accepted_past_the_cut_grows_its_drafts() -> None:
    # A new tenant's first guess cuts each draft after two tokens in a compute-bound step. The
    # positions after the cut are never verified but by probes; accepted probes give their cost
    # back, so probing goes on while it pays and the drafts grow to the full length.
    sched = scheduler(linear_cost(0.008, 0.0026))
    decoding(sched, 8)
    drafted = quoting_steps(sched, 20)
    assert max(drafted[0]) < 4
    assert drafted[-1] == [4] * 8
    assert all(n > 0 for step in drafted for n in step)


def test_probes_spend_their_share_of_the_step_longest_cut_first() -> None:
    cost = linear_cost(0.010, 0.002)                # one request's step ~12 ms, a probe 2 ms
    probes = Probes()
    proposed = {"a": 2, "b": 3, "c": 3}
    picked = [probes.pick({"a": 0, "b": 1, "c": 3}, proposed, 1, cost) for _ in range(40)]
    taken = [p for p in picked if p]
    assert all(len(p) == 1 for p in taken)
    # 5% of a 20 ms step (1 + 4 kept drafts) a step: 1 ms; a 2 ms probe every 2 steps.
    assert len(taken) == pytest.approx(40 * PROBE_SHARE * 0.020 / 0.002, abs=1)
    # The one cut longest goes first; "b", cut after one token, is probed as "a" is; "c" is uncut.
    assert [p[0] for p in taken[:4]] == ["a", "b", "a", "b"]
    assert probes.pick({"a": 0}, {"a": 1}, 1, StepCost()) == []   # no curve: nothing to size by
    probes.forget("a")


def test_an_accepted_probe_gives_its_cost_back() -> None:
    cost = linear_cost(0.010, 0.002)
    wasted, paid = Probes(), Probes()
    counts = {"wasted": 0, "paid": 0}
    kept = {"a": 1, "b": 0}
    for _ in range(40):
        for name, probes in (("wasted", wasted), ("paid", paid)):
            for rid in probes.pick(kept, {"a": 4, "b": 4}, 1, cost):
                counts[name] += 1
                verified = kept[rid] + 1                          # the kept drafts and the probe
                probes.settle(rid, verified, verified if name == "paid" else verified - 1)
    # Rejected probes spend at most the share (and back off); accepted ones come back to the credit,
    # so a text whose cut positions are accepted is probed on every step the credit covers one.
    # A 14 ms step (1 + 1 kept draft): 0.7 ms of credit a step, a 2 ms probe.
    assert counts["wasted"] <= 40 * PROBE_SHARE * 0.014 / 0.002
    assert counts["paid"] >= 36
    paid.settle("a", 2, 2)                                        # no probe pending: nothing changes
    assert paid.pick({"a": 1}, {"a": 1}, 1, cost) == []          # nothing cut: no probe


def test_a_request_whose_probes_are_rejected_waits_longer_for_each_next_one() -> None:
    cost = linear_cost(0.010, 0.0001)               # probes so cheap that the credit always covers one
    probes = Probes()
    probed_at = []
    for step in range(1, 400):
        for rid in probes.pick({"a": 1}, {"a": 4}, 1, cost):
            probed_at.append(step)
            accepted = 2 if step >= 300 else 1          # the text starts quoting past its cut at step 300
            probes.settle(rid, 2, accepted)
    gaps = [b - a for a, b in itertools.pairwise(probed_at)]
    assert probed_at[0] == 1
    assert gaps[:5] == [min(PROBE_WAIT_FIRST * 2 ** i, PROBE_WAIT_MAX) for i in range(5)]   # 16, 32, 64, 128, 128
    # The first probe after step 300 is accepted; from then on it is probed every step.
    first_accepted = next(s for s in probed_at if s >= 300)
    assert first_accepted - 300 <= PROBE_WAIT_MAX
    assert probed_at[probed_at.index(first_accepted):] == list(range(first_accepted, 400))


def test_a_probe_never_verified_costs_nothing_and_one_never_settled_lapses() -> None:
    cost = linear_cost(0.010, 0.002)                # ~0.7 ms of credit a step, a 2 ms probe

    def steps_to_next_probe(probes: Probes) -> int:
        for step in range(1, 50):
            if probes.pick({"a": 1}, {"a": 4}, 1, cost):
                return step
        raise AssertionError("no probe in 50 steps")

    refunded, lapsed = Probes(), Probes()
    steps_to_next_probe(refunded)
    refunded.settle("a", 1, 0)                  # the budget left the kept draft only: position 1 unverified
    steps_to_next_probe(lapsed)
    lapsed.lapse()                              # the request was never planned this step
    lapsed.settle("a", 2, 2)                    # a later step's verdict is not this probe's
    # The refund pays for the next probe at once; the lapsed probe's cost is spent, so the credit
    # must build up again over a few steps (an accepted verdict would have refunded it too).
    assert steps_to_next_probe(refunded) == 1
    assert steps_to_next_probe(lapsed) > 1
