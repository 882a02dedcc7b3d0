#!/usr/bin/env python3
"""The server at an earlier commit against the working tree's, over real HTTP, side by side.

    python bench/server_ab.py --rev REV --rounds 40

Both ``kvhive serve`` processes (default model, default flags plus --kvhive-args) stay up on their
own ports and take turns, request by request, in an order that alternates every round, so load from
elsewhere on the machine hits both alike. Each round sends each server:
- a short chat prompt that is cached after round 0: TTFT and the time to 8 streamed tokens;
- a new ~1,000-token prompt (salted per round and server): TTFT of a cold prefill.

Printed: medians per server (the first 2 rounds are warm-up), and the median and quartiles of the
paired difference (working tree minus REV) of the cached TTFT.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
from router_real import wait_for  # bench/ is on sys.path: scripts run from there

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LONG = " ".join(f"Sentence {i} about the weather in town number {i * 7}." for i in range(60))


def start(root: str, extra: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    """``kvhive serve`` from the tree at ``root``; returns the process and its base URL once healthy."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": root}
    process = subprocess.Popen([sys.executable, "-m", "kvhive.cli", "serve", "--port", str(port),
                                "--log-level", "warning", *extra], cwd=root, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(f"{url}/health", lambda r: r.status_code == 200, 300, f"the server in {root}", process)
    except RuntimeError:
        process.kill()
        raise
    return process, url


def timed_chat(url: str, content: str, max_tokens: int) -> tuple[float, float]:
    """(TTFT, total) seconds of a greedy streamed chat completion."""
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    start_time, first = time.perf_counter(), None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                choices = json.loads(line[len("data: "):])["choices"]
                if choices and choices[0]["delta"].get("content"):
                    first = time.perf_counter() - start_time
    total = time.perf_counter() - start_time
    return (first if first is not None else total), total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", required=True, help="git revision to compare the working tree against")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--kvhive-args", default="", help="extra flags for both servers")
    args = ap.parse_args()
    old_root = tempfile.mkdtemp(prefix="kvhive-ab-")
    subprocess.run(["git", "worktree", "add", "--detach", old_root, args.rev], cwd=ROOT, check=True,
                   capture_output=True)
    extra = shlex.split(args.kvhive_args)
    servers: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    try:
        servers = {args.rev: start(old_root, extra), "now": start(ROOT, extra)}
        names = list(servers)
        results = {name: {"cached TTFT": [], "cached, 8 tokens": [], "cold TTFT": []} for name in names}
        for i in range(args.rounds):
            for name in names if i % 2 == 0 else names[::-1]:
                url = servers[name][1]
                ttft, total = timed_chat(url, "What is the capital of France?", 8)
                results[name]["cached TTFT"].append(ttft)
                results[name]["cached, 8 tokens"].append(total)
                results[name]["cold TTFT"].append(timed_chat(url, f"{i} {name} {LONG}", 1)[0])
        for name, series in results.items():
            cells = ", ".join(f"{what} {statistics.median(v[2:]) * 1000:.1f} ms" for what, v in series.items())
            print(f"{name}: {cells}")
        diffs = sorted(n - o for n, o in zip(results["now"]["cached TTFT"][2:], results[args.rev]["cached TTFT"][2:],
                                             strict=True))
        q1, median, q3 = (diffs[len(diffs) // 4], statistics.median(diffs), diffs[3 * len(diffs) // 4])
        print(f"cached TTFT, now - {args.rev}, paired: median {median * 1000:+.1f} ms "
              f"(quartiles {q1 * 1000:+.1f} / {q3 * 1000:+.1f} ms)")
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(timeout=30)
        subprocess.run(["git", "worktree", "remove", "--force", old_root], cwd=ROOT, capture_output=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
