"""``bench/draft_replay.py``'s pieces that need no model: the accepted count, the step-cost fit, the
replay's policies on synthetic outputs, and its rendering."""

from __future__ import annotations

import draft_replay as dr
import pytest

PROMPT_LEN = 120


def _prompt(workload: str, variant: int) -> list[int]:
    return [1000 + 7 * variant + i for i in range(PROMPT_LEN)]


def _truth(output) -> dict:
    """Outputs of every run of workload "w": ``output(variant)``."""
    outs = {f"w-c1/{v}": output(v) for v in range(dr.C1_REQUESTS)}
    outs |= {f"w-c8/{v}": output(v) for v in range(dr.C8)}
    return {"w": {"outputs": outs}}


COST = {"one_request": {"base_ms": 20.0, "draft_row_ms": 3.0},
        "requests": {"base_ms": 10.0, "request_ms": 6.0, "draft_row_ms": 4.0}}


def test_accepted_counts_the_matching_prefix_up_to_the_output_end() -> None:
    assert dr.accepted([5, 6, 7], [1, 5, 6, 9], 1) == 2
    assert dr.accepted([5, 6, 7], [1, 5, 6], 1) == 2          # the output ends
    assert dr.accepted([9], [1, 5], 1) == 0 and dr.accepted([], [1], 0) == 0


def test_fit_cost_recovers_a_line_and_a_plane() -> None:
    steps = [(1, 1 + d, (20 + 3 * d) / 1e3) for d in range(6)]
    steps += [(n, n + d, (10 + 6 * n + 4 * d) / 1e3) for n in (2, 5, 8) for d in (0, 3, 9)]
    cost = dr.fit_cost(steps)
    assert cost["one_request"]["base_ms"] == pytest.approx(20) and cost["one_request"]["draft_row_ms"] == pytest.approx(3)
    plane = cost["requests"]
    assert (plane["base_ms"], plane["request_ms"], plane["draft_row_ms"]) == pytest.approx((10, 6, 4))
    seconds = dr.clock(cost)
    assert seconds(1, 4) == pytest.approx(0.029) and seconds(8, 12) == pytest.approx((10 + 48 + 16) / 1e3)


def test_a_quoting_output_drafts_and_the_oracle_wastes_no_row() -> None:
    # Each output copies its prompt from token 10, with one wrong token every 25.
    def output(v: int) -> list[int]:
        out = _prompt("w", v)[10:90]
        return [t if i % 25 != 24 else 7 for i, t in enumerate(out)]
    truth = _truth(output)
    result = {p: dr.replay(("w",), _prompt, truth, p, dr.clock(COST))["w"] for p in dr.POLICIES}
    oracle = result["oracle"]
    for conc in ("c1", "c8"):
        assert oracle[conc]["draft_tokens"] == oracle[conc]["accepted"] > 0
        assert result["all"][conc]["draft_tokens"] >= result["sized"][conc]["draft_tokens"]
        assert result["sized"][conc]["ratio"] > 1.2
    assert result["sized"]["c1"]["ratio"] > 2         # a draft row costs 3 ms of a 20 ms step there
    # Every verified draft token of the oracle is a token the model emits: fewer steps than tokens.
    assert oracle["c8"]["steps_median_run"] < 80


def test_an_output_that_never_repeats_drafts_nothing_and_reads_one() -> None:
    truth = _truth(lambda v: [50_000 + 100 * v + i for i in range(40)])
    result = dr.replay(("w",), _prompt, truth, "sized", dr.clock(COST))["w"]
    for conc in ("c1", "c8"):
        assert result[conc]["draft_tokens"] == 0 and result[conc]["ratio"] == pytest.approx(1.0)


def test_render_lists_each_workload_and_concurrency() -> None:
    row = {"ratio": 1.2, "draft_tokens": 10, "accepted": 8, "steps_median_run": 5}
    record = {"step_cost": {"one_request": {**COST["one_request"], "steps": 3},
                            "requests": {**COST["requests"], "steps": 4}},
              "max_tokens": 128, "outputs_equal": "48 of 48", "measured": {"w": {"c1": 2.0, "c8": 1.1}},
              "replay": {p: {"w": {"c1": row, "c8": row}} for p in dr.POLICIES}}
    text = "\n".join(dr.render("draft_replay.json", record))
    assert "| w | c1 | 2.00x | 1.20x | 1.20x | 1.20x | 10 / 10 |" in text and "| w | c8 | 1.10x" in text
    assert "fitted on 7 decode steps" in text and "48 of 48" in text
