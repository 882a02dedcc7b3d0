"""A PNG of kvhive's operator page (``GET /dashboard``) taken with headless Chromium, for the docs.

    python scripts/dashboard_screenshot.py --url http://127.0.0.1:8000/dashboard   # a running server
    python scripts/dashboard_screenshot.py --start replica                         # starts one itself
    python scripts/dashboard_screenshot.py --start gateway --out docs/dashboard_gateway.png

With ``--url`` it starts nothing: it loads the page of a server you run (with API keys, pass one
with ``--key`` or the environment's ``KVHIVE_DASHBOARD_KEY``; the admin key shows every key's
sessions). With ``--start replica`` it starts ``kvhive serve`` on the default model with the
smallest settings, a CPU and a disk tier and a fresh admin key, opens two sessions and sends
completions (the same few prompts again and again, so most are cache hits) for ``--settle-s``
seconds so the page's series have points, takes the picture and stops the server; ``--start
gateway`` also starts ``kvhive gateway`` (with the same ``--admin-key``) in front of it and takes the
gateway's page. The key reaches Chromium as HTTP Basic credentials in the URL
(``http://admin:KEY@host/dashboard``): Chromium sends them when the page answers 401, and again
on the page's own polls of ``dashboard/data``. Chromium
(Debian's ``chromium`` package: ``apt-get install -y chromium``) runs with the flags below and a
throwaway profile; the page has ``--budget-ms`` of virtual time to poll its data before the picture.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple
from urllib.parse import quote, urlsplit, urlunsplit

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "docs" / "dashboard.png"
MODEL = "smollm2-135m"
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
# Prompts of several KV blocks each, so that sending one again is a prefix-cache hit.
PROMPTS = tuple(f"Order {n}: " + " ".join(f"item {i} costs {i * n % 17} coins;" for i in range(12)) + " Total:"
                for n in (3, 5, 7))
SESSION_PROMPTS = ("You answer from this manual: the pump starts with the red switch.",
                   "You are a terse assistant for a bakery's orders.")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class Screenshot(NamedTuple):
    """Where the picture went and how many bytes it has."""

    path: Path
    num_bytes: int


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description="Take a PNG of kvhive's /dashboard page with headless Chromium.")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--url", help="the page of a running server, e.g. http://127.0.0.1:8000/dashboard")
    source.add_argument("--start", choices=("replica", "gateway"),
                        help="start kvhive serve (and kvhive gateway in front) and take its page")
    p.add_argument("--key", default=os.environ.get("KVHIVE_DASHBOARD_KEY"),
                   help="with --url: the key to open the page with, sent as HTTP Basic credentials "
                        "(default: $KVHIVE_DASHBOARD_KEY; none: an open server)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the PNG to write (default: docs/dashboard.png)")
    p.add_argument("--window-size", default="1280,1600", help="WIDTH,HEIGHT in pixels (default: 1280,1600)")
    p.add_argument("--budget-ms", type=int, default=6000,
                   help="virtual time the page gets to load and poll before the picture (default: 6000)")
    p.add_argument("--settle-s", type=float, default=20.0,
                   help="with --start: seconds of repeated requests before the picture, so the page's "
                        "series (one sample per 5 s) have points (default: 20)")
    p.add_argument("--chromium", default=None, help="the browser binary (default: the first of "
                   f"{', '.join(CHROMIUM_NAMES)} on PATH)")
    args = p.parse_args(argv)
    width, _, height = args.window_size.partition(",")
    if not (width.isdigit() and height.isdigit() and 0 < int(width) <= 8192 and 0 < int(height) <= 16384):
        p.error(f"--window-size must be WIDTH,HEIGHT in pixels, got {args.window_size!r}")
    if not 0 < args.budget_ms <= 120_000:
        p.error("--budget-ms must be 1..120000")
    if not 0 <= args.settle_s <= 600:
        p.error("--settle-s must be 0..600")
    return args


def find_chromium(name: str | None) -> str:
    """The browser binary: ``name``, or the first of CHROMIUM_NAMES on PATH; SystemExit if none."""
    for candidate in ([name] if name else CHROMIUM_NAMES):
        found = shutil.which(candidate)
        if found:
            return found
    raise SystemExit("no Chromium found: apt-get install -y chromium (or pass --chromium PATH)")


def with_credentials(url: str, key: str | None) -> str:
    """``url`` carrying ``key`` as HTTP Basic credentials (user "admin"), or ``url`` itself without a key."""
    if not key:
        return url
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"admin:{quote(key, safe='')}@{parts.netloc.rpartition('@')[2]}"))


def take_screenshot(chromium: str, url: str, key: str | None, out: Path, window_size: str,
                    budget_ms: int) -> Screenshot:
    """Load ``url`` in headless Chromium, opened with ``key`` (None: no key), and write its picture to
    ``out``; SystemExit if the page is not an HTML page answered 200 (no picture of an error) or no PNG came."""
    check_page(url, key)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvhive-chromium-") as profile:
        cmd = [chromium, "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars",
               f"--window-size={window_size}", f"--virtual-time-budget={budget_ms}",
               f"--user-data-dir={profile}", f"--screenshot={out}", with_credentials(url, key)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if not out.is_file() or not out.read_bytes().startswith(PNG_SIGNATURE):
        raise SystemExit(f"Chromium wrote no PNG to {out} (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return Screenshot(out, out.stat().st_size)


def check_page(url: str, key: str | None) -> None:
    """SystemExit unless ``url`` answers 200 with HTML to ``key`` (a 401, 404 or JSON error is no dashboard)."""
    try:
        r = httpx.get(url, auth=None if not key else ("admin", key), timeout=30)
    except httpx.HTTPError as e:
        raise SystemExit(f"{url}: {e}") from None
    if r.status_code != 200 or not r.headers.get("content-type", "").startswith("text/html"):
        raise SystemExit(f"{url} answered {r.status_code} {r.headers.get('content-type', '')}: "
                         f"{r.text[:300]}")


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(process: subprocess.Popen, url: str, timeout_s: float = 300.0) -> None:
    """Wait until ``url``/health answers 200; SystemExit if the process ends or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{process.args[3]} exited with {process.returncode} before it was healthy")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise SystemExit(f"{url} was not healthy after {timeout_s:.0f} s")


@contextlib.contextmanager
def running(kind: str, *flags: str) -> Iterator[str]:
    """``kvhive KIND --port P FLAGS`` in a subprocess until the block ends; yields its base URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvhive.cli", kind, "--port", str(port), "--log-level", "warning", *flags]
    process = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(process, url)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def give_the_page_something(url: str, key: str, settle_s: float) -> None:
    """Two sessions and a few completions through ``url`` with ``key``, then for ``settle_s`` seconds
    one repeated completion a second (cache hits), so the page's series have samples over time."""
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=300) as client:
        for system in SESSION_PROMPTS:
            r = client.post("/v1/context", headers={"x-session-ttl": "3600"}, json={
                "model": MODEL, "max_tokens": 4, "messages": [{"role": "system", "content": system}]})
            r.raise_for_status()
        deadline, turn = time.monotonic() + settle_s, 0
        while turn < len(PROMPTS) or time.monotonic() < deadline:
            prompt = PROMPTS[turn % len(PROMPTS)]
            r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4})
            r.raise_for_status()
            turn += 1
            if turn >= len(PROMPTS):
                time.sleep(1.0)


def screenshot_started(kind: str, args: argparse.Namespace, chromium: str) -> Screenshot:
    """Start a replica (and a gateway in front when ``kind`` is "gateway") with a fresh admin key,
    fill it, take its page opened with that key."""
    admin_key = secrets.token_urlsafe(16)
    with tempfile.TemporaryDirectory(prefix="kvhive-dashboard-disk-") as disk, running(
            "serve", "--max-model-len", "1024", "--kv-cache-gb", "0.25", "--cpu-offload-gb", "0.05",
            "--disk-cache-dir", disk, "--admin-key", admin_key) as replica:
        with contextlib.ExitStack() as stack:
            page_host = replica
            if kind == "gateway":
                page_host = stack.enter_context(running("gateway", "--replica", replica, "--admin-key", admin_key))
            give_the_page_something(page_host, admin_key, args.settle_s)
            return take_screenshot(chromium, f"{page_host}/dashboard", admin_key, args.out, args.window_size,
                                   args.budget_ms)


def main(argv: list[str] | None = None) -> int:
    """Take the picture; print where it went."""
    args = parse_args(argv)
    chromium = find_chromium(args.chromium)
    if args.url:
        shot = take_screenshot(chromium, args.url, args.key, args.out, args.window_size, args.budget_ms)
    else:
        shot = screenshot_started(args.start, args, chromium)
    print(f"wrote {shot.path} ({shot.num_bytes} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
