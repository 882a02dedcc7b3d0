"""The soak drill's judgements: phases, which answers count as errors, lost sessions, the targets."""

from __future__ import annotations

import soak_figures as f
from soak_figures import Ledger, Record, Windows


def test_phases_follow_the_schedule_in_equal_slots() -> None:
    assert f.phase_at(0, 100) == "quiet"
    assert f.phase_at(15, 100) == "hostile"
    assert f.phase_at(25, 100) == "redis_stall"
    assert f.phase_at(45, 100) == "disk_full"
    assert f.phase_at(250, 100) == f.SCHEDULE[-1]
    assert f.slot_start("disk_full", 100) == (40, 50)


def test_a_refusal_on_a_full_disk_is_not_an_error_but_a_5xx_elsewhere_is() -> None:
    windows = Windows(disk_full=[(60.0, 70.0)], restart=[(70.0, 90.0)])
    assert f.judge(Record("context_create", "507", 0.1, 65), windows, 100) == "refused_not_durable"
    assert f.judge(Record("context_create", "507", 0.1, 20), windows, 100) == "error"
    assert f.judge(Record("chat", "507", 0.1, 65), windows, 100) == "error"          # a chat writes no record
    assert f.judge(Record("chat", "exception:ConnectError", 0.0, 80), windows, 100) == "restart"
    assert f.judge(Record("chat", "exception:ConnectError", 0.0, 30), windows, 100) == "error"
    assert f.judge(Record("chat_stream", "aborted", 1.0, 30), windows, 100) == "aborted"


def test_hostile_requests_are_refused_by_a_4xx_or_a_closed_connection() -> None:
    windows, hostile = Windows(), "hostile"
    assert f.judge_hostile(Record("deep_nesting", "400", 1, 10, hostile), windows, 100) == "refused"
    assert f.judge_hostile(Record("endless_header_line", "closed", 1, 10, hostile), windows, 100) == "refused"
    assert f.judge_hostile(Record("many_headers", "431", 1, 10, hostile), windows, 100) == "refused"
    assert f.judge_hostile(Record("huge_number", "500", 1, 10, hostile), windows, 100) == "5xx"
    assert f.judge_hostile(Record("huge_number", "200", 1, 10, hostile), windows, 100) == "unexpected"
    assert f.judge_hostile(Record("slow_headers", "held_open", 60, 10, hostile), windows, 100) == "unexpected"
    assert f.judge_hostile(Record("spam_session", "200", 1, 10, hostile), windows, 100) == "accepted"
    restart = Windows(restart=[(70.0, 90.0)])
    assert f.judge_hostile(Record("slow_headers", "closed", 30, 50, hostile), restart, 100) == "restart"
    assert f.judge_hostile(Record("deep_nesting", "400", 1, 80, hostile), restart, 100) == "refused"


def test_a_session_is_lost_only_when_it_must_still_exist() -> None:
    ledger = Ledger()
    ledger.created("kept", "disk", "k", ttl_s=300, at_s=0)
    ledger.created("gone", "disk", "k", ttl_s=300, at_s=0)
    ledger.created("old", "disk", "k", ttl_s=30, at_s=0)
    ledger.created("closing", "disk", "k", ttl_s=300, at_s=0)
    ledger.deleted("gone")
    ledger.deleting("closing")
    assert ledger.alive(100) == ["kept"]
    assert not ledger.missing("gone", 100, "404") and not ledger.missing("old", 100, "404")
    assert not ledger.missing("closing", 100, "404")
    assert ledger.missing("kept", 100, "missing at the end")
    assert ledger.losses() == {"kept": "disk: missing at the end"} and ledger.alive(100) == []


def test_latency_per_phase_counts_well_behaved_generations_outside_restarts() -> None:
    records = [Record("chat", "200", 1.0, 5), Record("chat", "200", 3.0, 15), Record("chat", "200", 9.0, 75),
               Record("context_delete", "200", 50.0, 15), Record("chat", "200", 50.0, 15, "hostile"),
               Record("chat", "500", 50.0, 15)]
    phases = f.phase_latency(records, Windows(restart=[(70.0, 80.0)]), 100)
    assert phases == {"quiet": {"requests": 1, "p50_s": 1.0, "p99_s": 1.0},
                      "hostile": {"requests": 1, "p50_s": 3.0, "p99_s": 3.0}}
    assert f.p99_ratio(phases) == 3.0


def test_targets_are_met_only_by_a_clean_run() -> None:
    windows, ledger = Windows(), Ledger()
    records = [Record("chat", "200", 1.0, 5), Record("chat", "200", 1.2, 15), Record("huge_number", "400", 0.1, 15,
                                                                                     "hostile")]
    figures = f.summarize(records, windows, ledger, [{"mode": "cached", "ok": True}], 100)
    figures["gauges"] = f.gauges({"disk": {"metrics": {"kvhive_sessions_live": 0.0}}},
                                 {"disk": {"metrics": {"kvhive_sessions_live": 0.0}}}, ["kvhive_sessions_live"])
    assert all(f.targets(figures).values())
    figures["hostile"]["5xx"] = 1
    figures["gauges"]["disk kvhive_sessions_live"]["back"] = False
    assert [name for name, ok in f.targets(figures).items() if not ok] == ["no 5xx from bad input",
                                                                          "gauges back to baseline"]
    held = f.summarize([*records, Record("slow_headers", "held_open", 60, 15, "hostile")], windows, ledger, [], 100)
    held["gauges"] = {}
    assert [name for name, ok in f.targets(held).items() if not ok] == [
        "no wrong greedy answer", "every hostile request refused (4xx or a closed connection)"]


def test_a_drill_result_renders_with_every_target() -> None:
    import soak_report

    records = [Record("chat", "200", 1.0, 5), Record("chat", "200", 1.2, 15), Record("huge_number", "400", 0.1, 15,
                                                                                     "hostile")]
    record = f.summarize(records, Windows(), Ledger(), [{"mode": "cached", "ok": True}], 100)
    record["sessions"]["checks"] = {"at_end": {"checked": 0, "statuses": {}}}
    record["gauges"] = f.gauges({"disk": {"metrics": {"kvhive_sessions_live": 0.0}}},
                                {"disk": {"metrics": {"kvhive_sessions_live": 1.0}}}, ["kvhive_sessions_live"])
    record |= {"targets": f.targets(record), "config": {"clients": 4, "hostile_clients": 1, "minutes": 1, "disk_mb": 64,
                                                        "schedule": f.SCHEDULE},
               "events": [{"at_s": 30.0, "event": "redis SIGSTOP"}], "healthy_after": {"disk": True},
               "server_exit_codes": {"disk": [0, 0]}, "rss_mb": {"disk": {"before": 1.0, "after": 2.0, "max": 3.0}}}
    text = "\n".join(soak_report.lines(record))
    for target in record["targets"]:                       # each target's row, with its figure
        assert f"| {target} |" in text and f"| {target} | - |" not in text
    assert "| gauges back to baseline | 0 of 1 | **no** |" in text
    assert "| disk kvhive_sessions_live | 0 | 1 | **no** |" in text
