"""The live page on a real replica (tiny model, a CPU tier, two API keys and an admin key, sessions
of both keys): ``/dashboard/data`` agrees with ``/metrics`` and ``/v1/context``, shows a key only
its own sessions and usage (the admin every key's); the page and its data are a 401 without a key
(Bearer, x-api-key or Basic); and headless Chromium, given the key as Basic credentials in the URL,
renders the same numbers from ``/dashboard``."""

from __future__ import annotations

import html
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.api import assert_error
from support.servers import (
    SERVED_MODEL_NAME,
    ServerProcess,
    metric_samples,
    start_server,
    stop_server,
    wait_until,
)

KEYS = ("dash-key-1", "dash-key-2")
ADMIN = "dash-admin"
PROMPTS = {KEYS[0]: [list(range(10, 80)), list(range(200, 300))], KEYS[1]: [list(range(400, 470))]}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


CHALLENGE = 'Basic realm="kvhive dashboard", charset="UTF-8"'


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[ServerProcess, dict[str, Any]]]:
    """The server, and what the fixture made there: each key's session ids and prompt tokens."""
    server = start_server("tiny", api_keys=KEYS, max_model_len=2048,
                          extra_args=("--cpu-offload-gb", "0.01", "--admin-key", ADMIN))
    made: dict[str, Any] = {"sessions": {}, "prompt_tokens": {}, "requests": {}}
    try:
        with httpx.Client(base_url=server.base_url, timeout=60) as c:
            for key, prompts in PROMPTS.items():
                for prompt in prompts:
                    r = c.post("/v1/context", json={"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": 2},
                               headers=auth(key))
                    assert r.status_code == 200, r.text
                    made["sessions"].setdefault(key, []).append(r.headers["x-session-id"])
                    made["prompt_tokens"][key] = made["prompt_tokens"].get(key, 0) + r.json()["usage"]["prompt_tokens"]
            # The same prompt again under the first key: a prefix-cache hit.
            r = c.post("/v1/completions", json={"model": SERVED_MODEL_NAME, "prompt": PROMPTS[KEYS[0]][0],
                                                "max_tokens": 2}, headers=auth(KEYS[0]))
            assert r.status_code == 200, r.text
            made["prompt_tokens"][KEYS[0]] += r.json()["usage"]["prompt_tokens"]
            made["requests"] = {KEYS[0]: 3, KEYS[1]: 1}
        yield server, made
    finally:
        stop_server(server)


def data(server: ServerProcess, key: str) -> dict[str, Any]:
    r = httpx.get(f"{server.base_url}/dashboard/data", headers=auth(key), timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def cards(body: dict[str, Any]) -> dict[str, float]:
    return {c["id"]: c["value"] for c in body["cards"]}


def table(body: dict[str, Any], table_id: str) -> list[dict[str, Any]]:
    found = next(t for t in body["tables"] if t["id"] == table_id)
    return [dict(zip(found["columns"], row, strict=True)) for row in found["rows"]]


# Card -> the /metrics sample it shows (labels: all must match).
CARD_METRICS = {
    "requests_running": ("kvhive_num_requests_running", {}),
    "requests_waiting": ("kvhive_num_requests_waiting", {}),
    "device_kv_usage": ("kvhive_kv_cache_usage_perc", {}),
    "prefix_cache_queries_tokens": ("kvhive_prefix_cache_queries_total", {}),
    "prefix_cache_hits_tokens": ("kvhive_prefix_cache_hits_total", {}),
    "store_cache_hits_tokens": ("kvhive_store_prefix_cache_hits_total", {}),
    "tier_cpu_used_bytes": ("kvhive_kv_tier_usage_bytes", {"tier": "cpu"}),
}


def metric_values(server: ServerProcess) -> dict[str, float]:
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    return {card: metric_samples(text, name, labels)[0] for card, (name, labels) in CARD_METRICS.items()}


def settled_cards(server: ServerProcess, read_cards) -> tuple[dict[str, float], dict[str, float]]:
    """Cards read between two equal /metrics reads (the CPU tier's writer may still be storing)."""
    result: dict[str, Any] = {}

    def agree() -> bool:
        before = metric_values(server)
        shown = read_cards()
        result.update(metrics=before, cards=shown)
        return before == metric_values(server)
    wait_until(agree, 30, "/metrics to settle")
    return result["metrics"], result["cards"]


def test_the_data_needs_a_key(served) -> None:
    server, _ = served
    url = f"{server.base_url}/dashboard/data"
    for headers in ({}, auth("not-a-key"), {"Authorization": KEYS[0]}):
        assert_error(httpx.get(url, headers=headers, timeout=30), 401, code="invalid_api_key")
    assert httpx.get(url, headers={"x-api-key": KEYS[1]}, timeout=30).status_code == 200
    # The endpoint takes no query parameters: one is a 400 naming it, not ignored.
    assert_error(httpx.get(f"{url}?window=60", headers=auth(KEYS[1]), timeout=30), 400, param="window")
    # The body limit of every endpoint: a 2 MiB body (the limit is 1 MiB here) is refused unread.
    big = httpx.request("GET", url, headers=auth(KEYS[1]), content=b"x" * (2 << 20), timeout=30)
    assert_error(big, 413, code="request_too_large")


def test_the_page_needs_a_key_and_takes_it_as_basic_auth_too(served) -> None:
    server, _ = served
    for path in ("/dashboard", "/dashboard/data"):
        url = f"{server.base_url}{path}"
        for refused in (httpx.get(url, timeout=30), httpx.get(url, headers=auth("not-a-key"), timeout=30),
                        httpx.get(url, auth=("x", "not-a-key"), timeout=30)):
            assert_error(refused, 401, code="invalid_api_key")
            assert refused.headers["www-authenticate"] == CHALLENGE      # a browser asks for the key
        for answer in (httpx.get(url, headers=auth(KEYS[0]), timeout=30),
                       httpx.get(url, auth=("x", KEYS[1]), timeout=30), httpx.get(url, auth=("", ADMIN), timeout=30)):
            assert answer.status_code == 200, answer.text
    page = httpx.get(f"{server.base_url}/dashboard", auth=("x", KEYS[0]), timeout=30)
    assert page.headers["content-type"].startswith("text/html") and "dashboard/data" in page.text
    # Basic's key is the viewer's key: its own sessions only.
    basic_view = httpx.get(f"{server.base_url}/dashboard/data", auth=("x", KEYS[1]), timeout=30).json()
    assert {row["id"] for row in table(basic_view, "sessions")} == {
        row["id"] for row in table(data(server, KEYS[1]), "sessions")}


def test_the_numbers_are_those_of_metrics(served) -> None:
    server, _ = served
    metrics, shown = settled_cards(server, lambda: cards(data(server, KEYS[0])))
    assert {card: shown[card] for card in CARD_METRICS} == pytest.approx(metrics, abs=1e-4)
    assert shown["prefix_cache_hits_tokens"] > 0 and shown["tier_cpu_used_bytes"] > 0


def test_a_key_sees_its_own_sessions_as_the_sessions_api_shows_them(served) -> None:
    server, made = served
    body = data(server, KEYS[0])
    rows = {row["id"]: row for row in table(body, "sessions")}
    assert set(rows) == set(made["sessions"][KEYS[0]]) and "owner" not in next(iter(rows.values()))
    for session_id, row in rows.items():
        shown = httpx.get(f"{server.base_url}/v1/context/{session_id}", headers=auth(KEYS[0]), timeout=30).json()
        assert (row["tokens"], row["blocks"]) == (shown["tokens"], shown["num_blocks"])
        assert {tier: row[f"{tier}_blocks"] for tier in shown["blocks"]} == shown["blocks"]
        assert 0 < row["expires_in_s"] <= shown["ttl"]
    assert cards(body)["sessions_live"] == len(made["sessions"][KEYS[0]])
    usage = table(body, "usage")
    assert len(usage) == 1 and usage[0]["requests"] == made["requests"][KEYS[0]]
    assert usage[0]["prompt_tokens"] == made["prompt_tokens"][KEYS[0]]


def test_another_key_s_sessions_are_never_shown(served) -> None:
    server, made = served
    text = httpx.get(f"{server.base_url}/dashboard/data", headers=auth(KEYS[1]), timeout=30).text
    for session_id in made["sessions"][KEYS[0]]:
        assert session_id not in text
    assert KEYS[0] not in text and KEYS[1] not in text and ADMIN not in text       # keys never shown
    assert {row["id"] for row in table(data(server, KEYS[1]), "sessions")} == set(made["sessions"][KEYS[1]])


def test_the_admin_key_sees_every_key_s_sessions_and_usage(served) -> None:
    server, made = served
    body = data(server, ADMIN)
    rows = table(body, "sessions")
    assert {row["id"] for row in rows} == {s for ids in made["sessions"].values() for s in ids}
    assert len({row["owner"] for row in rows}) == 2
    usage = sorted((row["requests"], row["prompt_tokens"]) for row in table(body, "usage"))
    assert usage == sorted((made["requests"][k], made["prompt_tokens"][k]) for k in KEYS)
    runtime = dict((row["item"], row["value"]) for row in table(body, "runtime"))
    version = httpx.get(f"{server.base_url}/version", timeout=30).json()
    assert runtime["device"] == version["device"] and runtime["cpu_isa"] == (version["cpu_isa"] or "-")
    assert {item[5:]: value for item, value in runtime.items() if item.startswith("path:")} == version["paths"]


# The command the browser test runs (the URL appended): headless, no GPU, no sandbox (CI runs as
# root), its own profile, and 5 s of virtual time for the page to fetch and render its data. The
# URL carries the key as Basic credentials (http://x:KEY@host/dashboard): Chromium sends them after
# the page's 401 challenge, and again on the page's fetch of dashboard/data.
CHROMIUM = ("chromium", "--headless", "--disable-gpu", "--no-sandbox", "--virtual-time-budget=5000", "--dump-dom")


def rendered_page(url: str, profile: Path) -> str:
    """The page's DOM after Chromium ran its script."""
    done = subprocess.run([*CHROMIUM, f"--user-data-dir={profile}", url], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def rendered_cards(dom: str) -> dict[str, float]:
    return {name: float(value) for name, value in re.findall(r'data-card="([\w]+)" data-value="([^"]*)"', dom)}


def rendered_sessions(dom: str) -> dict[str, dict[str, str]]:
    """Session id -> column -> cell (a number's raw value, else its text), from the rendered sessions table."""
    found = re.search(r'<table data-table="sessions">(.*?)</table>', dom, re.S)
    assert found, "no sessions table rendered"
    rows = {}
    for row in re.findall(r'<tr data-row="\d+">(.*?)</tr>', found.group(1), re.S):
        cells = {}
        for col, attrs, text in re.findall(r'<td data-col="(\w+)"([^>]*)>(.*?)</td>', row):
            value = re.search(r'data-value="([^"]*)"', attrs)      # numbers carry their raw value
            cells[col] = value.group(1) if value else html.unescape(text)
        rows[cells["id"]] = cells
    return rows


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium (scripts/test.sh installs it)")
def test_a_browser_renders_the_numbers_of_metrics_and_sessions(served, tmp_path: Path) -> None:
    server, made = served
    dom_box: dict[str, str] = {}

    def read_rendered() -> dict[str, float]:
        url = server.base_url.replace("http://", f"http://x:{KEYS[0]}@", 1)
        dom_box["dom"] = rendered_page(f"{url}/dashboard", tmp_path / "profile")
        return rendered_cards(dom_box["dom"])
    metrics, shown = settled_cards(server, read_rendered)
    dom = dom_box["dom"]
    assert 'id="status" data-state="ok"' in dom
    assert {card: shown[card] for card in CARD_METRICS} == pytest.approx(metrics, abs=1e-4)
    sessions = rendered_sessions(dom)
    assert set(sessions) == set(made["sessions"][KEYS[0]])
    listed = httpx.get(f"{server.base_url}/v1/context", headers=auth(KEYS[0]), timeout=30).json()["data"]
    for session in listed:
        assert sessions[session["id"]]["tokens"] == str(session["tokens"])
        assert sessions[session["id"]]["blocks"] == str(session["num_blocks"])
    for session_id in made["sessions"][KEYS[1]]:
        assert session_id not in dom
    assert re.search(r'<svg[^>]*data-series="prefix_cache_hit_rate"', dom)
