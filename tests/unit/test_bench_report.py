"""docs/benchmarks.md is what bench/report.py makes of bench/results/, and every result file is on it."""

from __future__ import annotations

import os

import report


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
