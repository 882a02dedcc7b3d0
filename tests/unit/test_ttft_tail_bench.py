"""bench/ttft_tail.py's arithmetic: the rates both servers run at and the paired ratios."""

from __future__ import annotations

import ttft_tail


def _probe(rate: float) -> dict:
    return {"random@sat": {"request_throughput": rate}}


def test_rates_are_fractions_of_the_slower_servers_saturating_rate() -> None:
    plan = ttft_tail.rates_plan(["random"], [0.5, 0.9], _probe(2.0), _probe(0.8))
    assert plan == [("random", 0.4), ("random", 0.8 * 0.9)]


def test_an_added_rounds_load_is_its_rate_over_the_saturating_rate_it_measured() -> None:
    plan = [("random", 0.8), ("random", 0.4)]
    assert ttft_tail.loads(plan, _probe(1.0), _probe(0.5)) == {"random@0.800": 1.6, "random@0.400": 0.8}


def test_ratios_are_kvhive_over_vllm_median_over_rounds_and_skip_probes() -> None:
    def runs(p90: float) -> dict:
        return {"random@0.400": {"p90_ttft_ms": p90, "median_ttft_ms": 100.0}, "random@sat": {"p90_ttft_ms": 1.0}}

    rounds = [{"kvhive": runs(90.0), "vllm": runs(100.0)}, {"kvhive": runs(130.0), "vllm": runs(100.0)},
              {"kvhive": runs(110.0), "vllm": runs(100.0)}]
    ratios = ttft_tail.ratios(rounds)
    assert list(ratios) == ["random@0.400"]
    assert ratios["random@0.400"]["p90_ttft_ms"] == 1.1 and ratios["random@0.400"]["median_ttft_ms"] == 1.0


def test_the_report_shows_each_runs_ratio_with_both_servers_figures() -> None:
    import report

    def runs(p90: float) -> dict:
        return {"random@0.400": {m: 100.0 for m in ttft_tail.METRICS} | {"p90_ttft_ms": p90}}

    rounds = [{"kvhive": runs(90.0), "vllm": runs(100.0)}, {"kvhive": runs(70.0), "vllm": runs(100.0)}]
    record = {"machine": "x", "command": "c", "peer": "vLLM", "saturating_rate": {"random": 0.8},
              "rounds": rounds, "ratio_kvhive_over_vllm": ttft_tail.ratios(rounds)}
    row = next(line for line in report.render_ttft_tail("ttft_tail.json", record) if line.startswith("| random@"))
    assert "**0.80x** (80 / 100 ms)" in row and "**1.00x** (100 / 100 ms)" in row


def test_an_extended_result_pairs_each_run_over_the_rounds_that_ran_it() -> None:
    import report

    def runs(keys: tuple[str, ...], p90: float) -> dict:
        return {k: {m: 100.0 for m in ttft_tail.METRICS} | {"p90_ttft_ms": p90} for k in keys}

    both, tail = ("prefix_repetition@0.600", "random@0.400"), ("random@0.400",)
    rounds = [{"kvhive": runs(both, 90.0), "vllm": runs(both, 100.0)},
              {"kvhive": runs(both, 150.0), "vllm": runs(both, 100.0)},
              {"kvhive": runs(tail, 80.0), "vllm": runs(tail, 100.0),        # a round of random alone
               "load": {"random@0.400": 0.55}}]
    ratios = ttft_tail.ratios(rounds)
    assert list(ratios) == list(both)
    assert ratios["prefix_repetition@0.600"]["p90_ttft_ms"] == 1.2              # median of 0.9 and 1.5
    assert ratios["random@0.400"]["p90_ttft_ms"] == 0.9                         # median of 0.9, 1.5, 0.8
    record = {"machine": "x", "command": "c", "peer": "vLLM", "saturating_rate": {"random": 0.8},
              "rounds": rounds, "ratio_kvhive_over_vllm": ratios,
              "extended_by": [{"command": "python bench/ttft_tail.py --extend r", "date": "d"}]}
    lines = report.render_ttft_tail("ttft_tail.json", record)
    row = next(line for line in lines if line.startswith("| random@"))
    assert row.startswith("| random@0.400 | 3 |") and "**0.90x** (90 / 100 ms)" in row
    assert next(line for line in lines if line.startswith("| prefix_repetition@")).startswith("| prefix_repetition@0.600 | 2 |")
    assert "Rounds added by `python bench/ttft_tail.py --extend r` (d)." in lines
    assert ("Round 3, re-probed on its machine: each run's rate over that machine's saturating rate: "
            "random@0.400 0.55.") in lines
