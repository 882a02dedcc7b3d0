"""bench/restart_turn.py's summary (the first turn after each restart over the median warm turn) and
its section of the benchmarks page."""

from __future__ import annotations

import report
import restart_turn


def test_first_turns_are_compared_with_the_median_warm_turn() -> None:
    warm = [{"ttft_s": t} for t in (0.10, 0.30, 0.12)]
    restarts = [[{"ttft_s": 0.18}, {"ttft_s": 0.1}], [{"ttft_s": 0.36}, {"ttft_s": 0.1}]]
    summary = restart_turn.summarise(warm, restarts)
    assert summary["warm_ttft_s"] == 0.12
    assert summary["first_after_restart_s"] == [0.18, 0.36]
    assert summary["ratio_first_over_warm"] == [1.5, 3.0] and summary["median_ratio"] == 2.25
    record = {"machine": "m", "command": "c", "warm": warm, **summary}
    lines = report.render_restart_turn("restart_turn.json", record)
    assert "| first turn after restart 2 | 360 ms | 3.00x |" in lines
    assert lines[-2].endswith("**2.25x** |")


def test_the_conversation_text_is_the_same_on_every_run() -> None:
    assert restart_turn.text(3, 50) == restart_turn.text(3, 50) != restart_turn.text(4, 50)
    assert len(restart_turn.text(3, 50).split()) == 50
