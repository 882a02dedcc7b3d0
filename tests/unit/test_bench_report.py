"""docs/benchmarks.md is what bench/report.py makes of bench/results/, and every result file is on it."""

from __future__ import annotations

import os

import messages_agent
import report
import retention_priority


def test_benchmarks_page_is_generated_from_the_results() -> None:
    text, _ = report.generate()
    with open(report.PAGE, encoding="utf-8") as f:
        assert f.read() == text, "docs/benchmarks.md is stale: run python bench/report.py"


def test_every_result_file_has_a_section() -> None:
    _, used = report.generate()
    assert sorted(set(os.listdir(report.RESULTS)) - used) == []


def test_every_notes_file_belongs_to_a_section() -> None:
    keys = {"intro"} | {section.key for section in report.SECTIONS}
    assert {name.removesuffix(".md") for name in os.listdir(report.NOTES)} <= keys


def test_machine_line_says_what_was_not_recorded() -> None:
    assert report.machine_line({}) == "Machine: not recorded."
    assert report.machine_line({"machine": "x86_64, 2 cores"}) == (
        "Machine: CPU not recorded (x86_64); ISA flags: not recorded; 2 cores.")
    assert report.machine_line({"machine": "AMD EPYC (flags: avx2 fma), 2 cores"}) == (
        "Machine: CPU AMD EPYC; ISA flags: avx2 fma; 2 cores.")


def _retention_run(cached: list[int], prefix: int = 64) -> dict:
    rows = [{"kind": "oneoff", "index": 0, "ttft_s": 0.3, "cached_tokens": 0}]
    rows += [{"kind": "prefix", "index": 0, "use": use, "ttft_s": 0.05 if c else 0.4, "cached_tokens": c}
             for use, c in enumerate([0, *cached])]
    return {"rows": rows, "wall_s": 1.0, "load_average_1m": [1.0, 1.0]}


def test_retention_hit_rate_counts_repeat_questions_up_to_the_document() -> None:
    s = retention_priority.summarize(_retention_run([64, 80, 16, 0]), 64)
    assert s["repeats"] == 4 and s["full_hits"] == 2
    assert s["hit_rate"] == (64 + 64 + 16) / (4 * 64)       # the first question is left out; 80 counts as 64


def test_retention_target_is_judged_on_every_round() -> None:
    record = {"setup": {"prefix_tokens": 64}, "rounds": [
        {"priority": _retention_run([64, 64, 64]), "lru": _retention_run([0, 0, 64])},
        {"priority": _retention_run([64, 64, 0]), "lru": _retention_run([0, 0, 0])}]}
    assert "not met" in retention_priority.targets(record)[0]      # round 2's priority arm: 0.667
    record["rounds"][1]["priority"] = _retention_run([64, 64, 64])
    assert "(target ≥ 0.95 where LRU < 0.5: met)" in retention_priority.targets(record)[0]


def test_messages_agent_counts_the_prompt_as_anthropic_does() -> None:
    def row(turn: int, read: int, created: int, uncached: int, ttft: float) -> dict:
        return {"agent": 0, "turn": turn, "ttft_s": ttft, "input_tokens": uncached, "output_tokens": 8,
                "cache_creation_input_tokens": created, "cache_read_input_tokens": read}

    kv = [{"rows": [row(1, 0, 3700, 100, 2.0), row(2, 3700, 380, 20, 0.2)], "wall_s": 3, "load_average_1m": [1, 1]}]
    vl = [{"rows": [row(1, 0, 3712, 88, 2.5), row(2, 3712, 384, 4, 0.4)], "wall_s": 4, "load_average_1m": [1, 1]}]
    turns = messages_agent.per_turn(kv)
    assert [t["prompt_tokens"] for t in turns] == [3800, 4100]
    assert turns[1]["read_fraction"] == 3700 / 4100
    summary = messages_agent.summary_lines({"rounds": [{"kvhive": kv, "vllm": vl}]})
    assert "**0.50x** vLLM's" in summary[0]
