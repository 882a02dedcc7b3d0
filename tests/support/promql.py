"""The metric names a PromQL expression reads, found by one linear scan, and the Grafana dashboards of
``examples/grafana/`` they come from.

The scan knows as much PromQL as dashboards use: a name directly followed by ``(`` is a function or
an aggregation; keywords (``by``, ``without``, ``on``, ``ignoring``, ``group_left``, ``group_right``,
``and``, ``or``, ``unless``, ``bool``, ``offset``, the aggregation operators) are not names; the
parenthesized label list after a grouping keyword is skipped; ``{...}`` holds label matchers (their
names are kept, their string values skipped); ``[...]`` is a range or a subquery step. Grafana's
``$variables`` are skipped. What is left is a metric name, as Prometheus stores it: a sample name
(``x_total``, ``x_bucket``, ``x_sum``, ``x_count`` or a gauge's own name), which is what a scrape of
``/metrics`` shows.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import NamedTuple

from support.servers import REPO_ROOT

GRAFANA_DIR = os.path.join(REPO_ROOT, "examples", "grafana")
AGGREGATIONS = frozenset({"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
                          "bottomk", "topk", "quantile", "limitk", "limit_ratio"})
GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
KEYWORDS = AGGREGATIONS | GROUPING | frozenset({"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan"})
# Labels Prometheus adds to every series it scrapes; the process never exports them itself.
TARGET_LABELS = frozenset({"instance", "job"})
_NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_NUMBER = re.compile(r"[0-9.][0-9A-Za-z_.+]*")   # 0.99, 1e3, 0x1f, a duration: 5m, 1h30m
_VARIABLE = re.compile(r"\$(\{[^}]*\}|[A-Za-z0-9_]+)")
_LABEL_VALUES = re.compile(r"^\s*label_values\((?:(.*),)?\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*$", re.S)


class MetricRef(NamedTuple):
    """One metric name an expression reads: its label matchers' names and whether it has a range."""

    name: str
    labels: tuple[str, ...]
    ranged: bool


class PromQLError(ValueError):
    """An expression the scan cannot read (an unclosed string, brace or bracket)."""


def _skip_string(expr: str, i: int) -> int:
    """The index after the string literal starting at ``expr[i]`` (a quote or a backtick)."""
    quote, i = expr[i], i + 1
    while i < len(expr):
        if expr[i] == "\\" and quote != "`":
            i += 2
        elif expr[i] == quote:
            return i + 1
        else:
            i += 1
    raise PromQLError(f"unclosed string in {expr!r}")


def _closing(expr: str, i: int, close: str) -> int:
    """The index of ``close`` ending the bracket opened at ``expr[i]`` (strings inside skipped)."""
    i += 1
    while i < len(expr):
        if expr[i] in "\"'`":
            i = _skip_string(expr, i)
        elif expr[i] == close:
            return i
        else:
            i += 1
    raise PromQLError(f"unclosed {expr[i - 1] if i else ''!r}...{close!r} in {expr!r}")


def _label_names(matchers: str) -> tuple[str, ...]:
    """The label names of a ``{...}`` body: each name before its ``=``, ``!=``, ``=~`` or ``!~``."""
    names, i = [], 0
    while i < len(matchers):
        if matchers[i] in "\"'`":
            i = _skip_string(matchers, i)
            continue
        match = _NAME.match(matchers, i)
        if match:
            names.append(match.group())
            i = match.end()
        else:
            i += 1
    return tuple(names)


def _next_char(expr: str, i: int) -> tuple[str, int]:
    """The first character at or after ``i`` that is not white space, and its index ("" at the end)."""
    while i < len(expr) and expr[i].isspace():
        i += 1
    return (expr[i], i) if i < len(expr) else ("", i)


def metric_refs(expr: str) -> list[MetricRef]:
    """Every metric an expression reads, in order (one linear scan: each character is looked at a
    bounded number of times)."""
    refs, i = [], 0
    while i < len(expr):
        c = expr[i]
        if c in "\"'`":
            i = _skip_string(expr, i)
        elif c == "$":
            match = _VARIABLE.match(expr, i)
            i = match.end() if match else i + 1
        elif c == "{":                   # a selector with no name: {__name__=...} is not used here
            i = _closing(expr, i, "}") + 1
        elif c == "[":
            i = _closing(expr, i, "]") + 1
        elif c.isdigit() or (c == "." and expr[i + 1:i + 2].isdigit()):
            i = _NUMBER.match(expr, i).end()
        elif _NAME.match(expr, i):
            ref, i = _read_name(expr, _NAME.match(expr, i))
            if ref is not None:
                refs.append(ref)
        else:
            i += 1
    return refs


def _read_name(expr: str, match: re.Match) -> tuple[MetricRef | None, int]:
    """A name at ``match``: a metric (with its matchers and range) or a function/keyword (None); and
    the index to scan on from."""
    name, i = match.group(), match.end()
    nxt, j = _next_char(expr, i)
    if name.lower() in GROUPING:
        return None, (_closing(expr, j, ")") + 1 if nxt == "(" else i)
    if nxt == "(" or name.lower() in KEYWORDS:
        return None, i
    labels: tuple[str, ...] = ()
    if nxt == "{":
        end = _closing(expr, j, "}")
        labels, i = _label_names(expr[j + 1:end]), end + 1
        nxt, j = _next_char(expr, i)
    return MetricRef(name, labels, nxt == "["), i


class DashboardQuery(NamedTuple):
    """One PromQL expression of a dashboard and where it is (panel title or variable name)."""

    where: str
    expr: str


def load_dashboard(file_name: str) -> dict:
    """The dashboard JSON ``examples/grafana/<file_name>``."""
    with open(os.path.join(GRAFANA_DIR, file_name)) as f:
        return json.load(f)


def dashboard_files() -> list[str]:
    """The dashboard files in examples/grafana/."""
    return sorted(name for name in os.listdir(GRAFANA_DIR) if name.endswith(".json"))


def panel_queries(dashboard: dict) -> Iterator[DashboardQuery]:
    """Each target's expression of each panel (rows' nested panels included)."""
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            for target in inner.get("targets", []):
                yield DashboardQuery(inner["title"], target["expr"])


def variable_queries(dashboard: dict) -> Iterator[tuple[str, str, str]]:
    """(variable, series selector, label) of each ``label_values(selector, label)`` query variable."""
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        match = _LABEL_VALUES.match(query)
        if match is None:
            raise PromQLError(f"variable {variable['name']}: not a label_values() query: {query!r}")
        yield variable["name"], match.group(1) or "", match.group(2)


class ExportedSample(NamedTuple):
    """A sample name of a scrape: its family's type and the label names its series carry (None: the
    family is declared, by its ``# TYPE`` line, but has no series yet)."""

    family_type: str
    labels: frozenset[str] | None


# The sample names of a family with no series yet, by type (a labelled counter shows its first
# series with its first event; its ``# TYPE`` line is there from the start).
DECLARED_SAMPLES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count"),
                    "summary": ("_sum", "_count")}


def exported_samples(metrics_text: str) -> dict[str, ExportedSample]:
    """{sample name: its family's type and labels} of one ``/metrics`` text (prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, ExportedSample] = {}
    for family in text_string_to_metric_families(metrics_text):
        if not family.samples:
            for suffix in DECLARED_SAMPLES.get(family.type, ()):
                found.setdefault(family.name + suffix, ExportedSample(family.type, None))
        for s in family.samples:
            seen = found.get(s.name)
            earlier = seen.labels if seen is not None and seen.labels is not None else frozenset()
            found[s.name] = ExportedSample(family.type, earlier | (set(s.labels) - {"le", "quantile"}))
    return found


NOT_EXPORTED = ExportedSample("", frozenset())


def _ref_problems(where: str, ref: MetricRef, exported: dict[str, ExportedSample]) -> Iterator[str]:
    """What is wrong with one metric reference: not exported, a label it lacks, a counter read raw."""
    sample = exported.get(ref.name)
    if sample is None:
        yield f"{where}: {ref.name} is not exported"
        return
    known = set(ref.labels) if sample.labels is None else sample.labels   # no series yet: unknown
    for label in set(ref.labels) - known - TARGET_LABELS:
        yield f"{where}: {ref.name} has no label {label}"
    if sample.family_type != "gauge" and not ref.ranged:
        yield f"{where}: {ref.name} ({sample.family_type}) is read without a range (rate/increase)"


def query_problems(dashboard: dict, exported: dict[str, ExportedSample]) -> list[str]:
    """Every expression and variable of ``dashboard`` checked against the samples a process exports."""
    problems = []
    for where, expr in panel_queries(dashboard):
        refs = metric_refs(expr)
        if not refs:
            problems.append(f"{where}: reads no metric: {expr!r}")
        for ref in refs:
            problems.extend(_ref_problems(where, ref, exported))
    for name, selector, label in variable_queries(dashboard):
        refs = metric_refs(selector)
        for ref in refs:
            problems.extend(_ref_problems(f"${name}", ref._replace(ranged=True), exported))
        if label not in TARGET_LABELS and not any(label in (exported.get(r.name, NOT_EXPORTED).labels or ())
                                                  for r in refs):
            problems.append(f"${name}: no series of {selector!r} has label {label}")
    return problems


def shape_problems(dashboard: dict) -> list[str]:
    """What keeps ``dashboard`` from importing as a Grafana dashboard of Prometheus panels."""
    problems = [f"missing {key}" for key in ("title", "uid", "schemaVersion", "panels", "templating")
                if key not in dashboard]
    if problems:
        return problems
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    source = variables.get("datasource", {})
    if source.get("type") != "datasource" or source.get("query") != "prometheus":
        problems.append("no datasource variable of type prometheus")
    ids = [p.get("id") for p in dashboard["panels"]]
    if len(set(ids)) != len(ids) or None in ids:
        problems.append(f"panel ids not unique: {ids}")
    for panel in dashboard["panels"]:
        grid = panel.get("gridPos", {})
        if sorted(grid) != ["h", "w", "x", "y"] or grid["x"] + grid["w"] > 24:
            problems.append(f"{panel.get('title')}: gridPos {grid}")
        if panel.get("type") == "row":
            continue
        targets = panel.get("targets") or []
        if not targets or any(not t.get("expr") for t in targets):
            problems.append(f"{panel.get('title')}: a panel needs targets, each with an expr")
        if len({t.get("refId") for t in targets}) != len(targets):
            problems.append(f"{panel.get('title')}: refIds not unique")
        if panel.get("datasource", {}).get("uid") != "${datasource}":
            problems.append(f"{panel.get('title')}: datasource is not ${{datasource}}")
    return problems
