"""A soak drill's result (``bench/soak.py``) as markdown lines for docs/benchmarks.md: the targets
met or not, latency per phase, the hostile requests' outcomes, sessions and gauges."""

from __future__ import annotations

from soak_figures import P99_RATIO_GOAL


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def number(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def outcome_cells(counts: dict[str, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or "-"


def targets_table(record: dict) -> list[str]:
    s, p, h, lat = record["sessions"], record["probes"], record["hostile"], record["latency"]
    phases, ratio = lat["phases"], lat["p99_ratio"]
    checks = "; ".join(f"{when.replace('_', ' ')}: {sum(c['statuses'].values())} looked up ({outcome_cells(c['statuses'])})"
                       for when, c in s["checks"].items())
    back = [g["back"] for g in record["gauges"].values()]
    figures = {
        "no lost session": f"{s['lost']} lost of {s['created']} created with a 200 ({checks})"
                           + (f"; lost: {outcome_cells(s['lost_by'])}" if s["lost"] else ""),
        "no wrong greedy answer": f"{p['wrong']} wrong of {p['answered']} probes ({outcome_cells(p['by_mode'])})",
        "no 5xx from bad input": f"{h['5xx']} of {h['requests']} hostile requests",
        "every hostile request refused (4xx or a closed connection)":
            f"{h['outcomes'].get('refused', 0)} refused, {h['unexpected']} not (table below)",
        "no well-behaved request failed (but for full-disk refusals and the restart)":
            f"{record['well_behaved']['num_errors']} of {record['well_behaved']['requests']} failed",
        f"hostile-phase p99 <= {P99_RATIO_GOAL}x quiet":
            f"{'-' if ratio is None else f'{ratio:.2f}x'} (p99 {seconds(phases.get('hostile', {}).get('p99_s'))} s "
            f"hostile, {seconds(phases.get('quiet', {}).get('p99_s'))} s quiet)",
        "gauges back to baseline": f"{sum(back)} of {len(back)}",
    }
    return ["| target | figure | met |", "| --- | --- | --- |",
            *(f"| {t} | {figures.get(t, '-')} | {'yes' if ok else '**no**'} |" for t, ok in record["targets"].items())]


def lines(record: dict) -> list[str]:
    """The whole rendering of one result."""
    cfg, w, h = record["config"], record["well_behaved"], record["hostile"]
    events = ", ".join(f"{e['event']} at {e['at_s']:.0f} s" for e in record["events"])
    out = [f"{cfg['clients']} clients ({cfg['hostile_clients']} hostile, on one API key) for {cfg['minutes']:g} "
           f"minutes against 2 replicas (`redis`: sessions and KV in Redis; `disk`: both on a {cfg['disk_mb']} MB "
           f"tmpfs), in {len(cfg['schedule'])} equal slots: {', '.join(cfg['schedule'])}. Events: {events}.", "",
           *targets_table(record), "",
           "Latency of well-behaved requests that generate, answered 2xx, per phase (a request counts in the phase "
           "it started in; none cut by the restart):", "",
           "| phase | requests | p50 (s) | p99 (s) |", "| --- | --- | --- | --- |",
           *(f"| {phase} | {f['requests']} | {seconds(f['p50_s'])} | {seconds(f['p99_s'])} |"
             for phase, f in record["latency"]["phases"].items()), "",
           f"Well-behaved requests: {w['requests']} ({outcome_cells(w['judged'])}); errors: "
           f"{outcome_cells(w['errors'])}. Sessions: {record['sessions']['created']} created, "
           f"{record['sessions']['deleted']} deleted, {record['sessions']['refused_not_durable']} refused as not "
           f"durable (507/503 while the disk was full). Hostile requests: {h['requests']} "
           f"({outcome_cells(h['outcomes'])}):", "",
           "| hostile request | outcomes (status) |", "| --- | --- |",
           *(f"| {kind} | {outcome_cells(o)} |" for kind, o in sorted(h["by_kind"].items())), "",
           "Gauges before the run and at the end (after the sessions left alive were deleted and the rest "
           "expired; the replicas restarted after the full disk, so these are the restarted processes'), and RSS:", "", "| replica gauge | before | after | back |", "| --- | --- | --- | --- |",
           *(f"| {key} | {number(g['before'])} | {number(g['after'])} | {'yes' if g['back'] else '**no**'} |"
             for key, g in record["gauges"].items())]
    rss = "; ".join(f"{name} {r['before']:.0f} / {r['after']:.0f} / {r['max']:.0f} MB" for name, r in record["rss_mb"].items()
                    if None not in r.values())
    return [*out, "", f"RSS before / after / max: {rss or 'not recorded'}. Healthy after: "
            f"{', '.join(f'{k}: ' + ('yes' if v else '**no**') for k, v in record['healthy_after'].items())}; exit codes "
            f"(restart, end): {', '.join(f'{k}: {v}' for k, v in record['server_exit_codes'].items())}.", ""]
