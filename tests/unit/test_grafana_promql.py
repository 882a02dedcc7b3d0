"""The Grafana dashboards of ``examples/grafana/`` without a server: each is an importable dashboard
shape, the PromQL scan finds the metric names an expression reads (and only those), a made-up name
or label is caught, and every name the dashboards read is a family docs/metrics.md lists.
``tests/e2e/test_grafana_dashboards.py`` checks the same names against real scrapes. Where
``promtool`` is installed (Debian's ``prometheus`` package), Prometheus's own parser reads every expression."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from support.promql import (
    MetricRef,
    PromQLError,
    dashboard_files,
    exported_samples,
    load_dashboard,
    metric_refs,
    panel_queries,
    query_problems,
    shape_problems,
    variable_queries,
)
from support.servers import REPO_ROOT

HISTOGRAM_PARTS = ("_bucket", "_sum", "_count")
# What Grafana puts in place of the dashboards' variables before Prometheus reads an expression.
GRAFANA_VALUES = {"$__rate_interval": "1m", "$instance": ".*", "$model_name": ".*", "$replica": ".*"}


def scrape_text() -> str:
    """A scrape as prometheus_client writes it: a counter, a gauge, a histogram, and a labelled
    counter with no series yet (its ``# TYPE`` line only)."""
    registry = CollectorRegistry()
    Counter("kvhive_failures", "f", ["replica"], registry=registry)
    Counter("kvhive_hits", "h", ["model_name", "tier"], registry=registry).labels("m", "cpu").inc(3)
    Gauge("kvhive_running", "r", ["model_name"], registry=registry).labels("m").set(1)
    Histogram("kvhive_ttft_seconds", "t", ["model_name"], buckets=(0.1,), registry=registry).labels("m").observe(0.05)
    return generate_latest(registry).decode()


def refs(expr: str) -> list[tuple[str, tuple[str, ...], bool]]:
    """(name, label names, has a range) of each metric ``expr`` reads."""
    return [tuple(r) for r in metric_refs(expr)]


def test_the_scan_skips_functions_keywords_grouping_labels_and_variables() -> None:
    expr = ('histogram_quantile(0.99, sum by (le, replica) (rate(kvhive_ttft_seconds_bucket{instance=~"$instance",'
            ' model_name=~"a{b}[c]"}[$__rate_interval])))')
    assert refs(expr) == [("kvhive_ttft_seconds_bucket", ("instance", "model_name"), True)]
    expr = ("sum(rate(a_total[5m] offset 1h)) / ignoring(replica) group_left sum without (tier) (b) "
            "and on(instance) c > bool 1e3 unless d{} or max(e) * inf")
    assert [r[0] for r in refs(expr)] == ["a_total", "b", "c", "d", "e"]
    assert refs("sum(rate(x_total[${__interval}])) / scalar(sum(y))") == [("x_total", (), True), ("y", (), False)]
    assert refs("count_values('v', z) + topk(3, w) + rate(q [1m:10s])") == [("z", (), False), ("w", (), False),
                                                                            ("q", (), True)]
    assert refs('m{a="\\"}", b!~`x"y`} / 0.5') == [("m", ("a", "b"), False)]


@pytest.mark.parametrize("expr", ['rate(x{a="b}[5m])', "rate(x[5m)", "x{a='b}"])
def test_an_unclosed_string_or_bracket_is_an_error(expr: str) -> None:
    with pytest.raises(PromQLError):
        metric_refs(expr)


def test_a_made_up_name_a_missing_label_and_a_raw_counter_are_caught() -> None:
    exported = exported_samples(scrape_text())
    assert set(exported) - {"kvhive_hits_created", "kvhive_ttft_seconds_created"} == {
        "kvhive_hits_total", "kvhive_running", "kvhive_ttft_seconds_bucket", "kvhive_ttft_seconds_count",
        "kvhive_ttft_seconds_sum", "kvhive_failures_total"}
    assert exported["kvhive_failures_total"].labels is None and exported["kvhive_running"].labels == {"model_name"}
    board = copy.deepcopy(load_dashboard("kvhive-gateway.json"))
    board["templating"]["list"] = [v for v in board["templating"]["list"] if v["type"] != "query"]
    board["panels"] = [{"id": 1, "title": "p", "targets": [{"expr": e} for e in (
        "sum(rate(kvhive_hits_total{tier=~'c.*'}[5m])) / sum(kvhive_running)",
        "histogram_quantile(0.9, sum by (le) (rate(kvhive_ttft_seconds_bucket{instance='i'}[5m])))",
        "rate(kvhive_made_up_total[5m])",
        "sum by (replica) (increase(kvhive_failures_total{replica='r'}[1h]))",
        "kvhive_hits_total",
        "kvhive_running{replica='r'}",
        "rate(kvhive_ttft_seconds[5m])",
        "vector(1)",
        "kvhive_failures_total",
    )]}]
    assert query_problems(board, exported) == [
        "p: kvhive_made_up_total is not exported",
        "p: kvhive_hits_total (counter) is read without a range (rate/increase)",
        "p: kvhive_running has no label replica",
        "p: kvhive_ttft_seconds is not exported",
        "p: reads no metric: 'vector(1)'",
        "p: kvhive_failures_total (counter) is read without a range (rate/increase)",
    ]


def test_each_dashboard_has_an_importable_shape() -> None:
    assert dashboard_files() == ["kvhive-gateway.json", "kvhive-replica.json"]
    for name in dashboard_files():
        board = load_dashboard(name)
        assert shape_problems(board) == [], name
        assert {v["name"] for v in board["templating"]["list"]} >= {"datasource", "instance"}
        assert sum(1 for _ in panel_queries(board)) >= 20, name


def test_a_broken_dashboard_shape_is_caught() -> None:
    board = copy.deepcopy(load_dashboard("kvhive-replica.json"))
    panels = [p for p in board["panels"] if p["type"] != "row"]
    panels[1]["id"] = panels[0]["id"]
    del panels[2]["gridPos"]
    panels[3]["targets"][0]["expr"] = ""
    panels[4]["datasource"] = {"type": "prometheus", "uid": "my-prometheus"}
    board["templating"]["list"] = board["templating"]["list"][1:]
    problems = shape_problems(board)
    assert len(problems) == 5, problems
    assert problems[0] == "no datasource variable of type prometheus"


def documented_families() -> dict[str, str]:
    """{name as docs/metrics.md writes it (counters with _total): type} of its tables."""
    with open(os.path.join(REPO_ROOT, "docs", "metrics.md")) as f:
        return dict(re.findall(r"^\| `(kvhive_\w+)` \| (\w+) \|", f.read(), re.M))


def documented_family_of(sample_name: str, families: dict[str, str]) -> str | None:
    """The documented family a sample name belongs to: itself (a gauge, a counter's ``_total``), or
    a histogram or summary whose ``_bucket``/``_sum``/``_count`` it is (a summary has no ``_bucket``)."""
    if sample_name in families:
        return sample_name
    for suffix in HISTOGRAM_PARTS:
        base = sample_name.removesuffix(suffix)
        if base != sample_name and (families.get(base) == "histogram"
                                    or (families.get(base) == "summary" and suffix != "_bucket")):
            return base
    return None


def test_every_name_the_dashboards_read_is_documented() -> None:
    families = documented_families()
    assert documented_family_of("kvhive_time_to_first_token_seconds_bucket", families)
    assert documented_family_of("kvhive_kv_tier_load_seconds_bucket", families) is None
    assert documented_family_of("kvhive_prefix_cache_hits", families) is None
    for name in dashboard_files():
        board = load_dashboard(name)
        read = [r for _, expr in panel_queries(board) for r in metric_refs(expr)]
        read += [r for _, selector, _ in variable_queries(board) for r in metric_refs(selector)]
        assert all(isinstance(r, MetricRef) for r in read)
        unknown = sorted({r.name for r in read if documented_family_of(r.name, families) is None})
        assert unknown == [], name


def promtool_check(rules: list[dict[str, str]], path) -> subprocess.CompletedProcess:
    """``promtool check rules`` of one group of recording ``rules`` written to ``path``."""
    path.write_text(json.dumps({"groups": [{"name": "dashboards", "rules": rules}]}))  # JSON is YAML
    return subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian's prometheus package) not installed")
def test_prometheus_parses_every_expression(tmp_path) -> None:
    rules = []
    for name in dashboard_files():
        for number, (_, expr) in enumerate(panel_queries(load_dashboard(name))):
            for variable, value in GRAFANA_VALUES.items():
                expr = expr.replace(variable, value)
            rules.append({"record": f"dashboard:{name.removesuffix('.json').replace('-', '_')}:{number}",
                          "expr": expr})
    assert len(rules) > 100
    done = promtool_check(rules, tmp_path / "rules.yml")
    assert done.returncode == 0, done.stderr
    done = promtool_check([*rules, {"record": "dashboard:broken", "expr": "sum by (le) (rate(x[5m])"}],
                          tmp_path / "broken.yml")
    failed = [line for line in done.stderr.splitlines() if "could not parse" in line]
    assert done.returncode == 1 and len(failed) == 1 and '"dashboard:broken"' in failed[0], done.stderr
