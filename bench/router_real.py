"""KV-aware routing vs round-robin with 2 real ``kvhive serve`` replicas (default model) behind the gateway.

    python bench/router_real.py [--customers 6] [--doc-tokens 600] [--requests 36] [--num-blocks 160]

For each policy: start 2 replicas (``kvhive serve --kv-events ... --kv-events-replay ...``, one
torch thread each, a small KV pool of ``--num-blocks`` blocks so that one replica holds only part of
the customers' documents), start ``kvhive gateway --policy P``, send the same sequence of requests
(a random customer's document + a short unique question, ``max_tokens`` 1, one at a time, so the
latency of a request is its time to first token), stop everything. Records the share of prompt
tokens served from the KV cache (``usage.prompt_tokens_details.cached_tokens``) and TTFT.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

import httpx
from run_info import command, machine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
WORDS = ("the contract states that each party shall deliver goods services payment notice within days "
         "of the order invoice warranty claim river mountain valley forest garden bridge tower market "
         "report data system network region cluster").split()
ENV = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, ok: Callable[[httpx.Response], bool], timeout_s: float, what: str,
             proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            if ok(httpx.get(url, timeout=2)):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"timed out waiting for {what}")


def stop(procs: Sequence[subprocess.Popen | None]) -> None:
    for proc in procs:
        if proc is not None and proc.poll() is None:
            proc.terminate()
    for proc in procs:
        if proc is not None:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


def start_kvhive_replica(log_dir: str, num_blocks: int, threads: int = 1) -> tuple[subprocess.Popen, str]:
    """A real ``kvhive serve`` with KV events; returns the process and its gateway --replica spec."""
    port, events, replay = free_port(), free_port(), free_port()
    cmd = [sys.executable, "-m", "kvhive.cli", "serve", "--port", str(port), "--max-model-len", "4096",
           "--num-blocks", str(num_blocks), "--num-threads", str(threads), "--log-level", "warning",
           "--kv-events", f"tcp://*:{events}", "--kv-events-replay", f"tcp://*:{replay}"]
    proc = subprocess.Popen(cmd, stdout=open(f"{log_dir}/replica-{port}.log", "w"), stderr=subprocess.STDOUT,
                            env=ENV, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    return proc, f"{url},events=tcp://127.0.0.1:{events},replay=tcp://127.0.0.1:{replay}"


def start_gateway(log_dir: str, specs: Sequence[str], policy: str = "kv") -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "kvhive.cli", "gateway", "--port", str(port), "--policy", policy,
           "--health-interval", "0.5", "--log-level", "info"]
    for spec in specs:
        cmd += ["--replica", spec]
    proc = subprocess.Popen(cmd, stdout=open(f"{log_dir}/gateway.log", "w"), stderr=subprocess.STDOUT,
                            env=ENV, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    wait_for(f"{url}/health", lambda r: r.status_code == 200 and set(r.json()["replicas"].values()) == {"up"},
             90, "the gateway", proc)
    return proc, url


def gateway_metric(url: str, name: str, labels: dict[str, str] | None = None) -> float:
    import re

    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if match and match.group(1) == name:
            found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
            if all(found.get(k) == v for k, v in (labels or {}).items()):
                total += float(match.group(3))
    return total


def make_docs(customers: int, doc_tokens: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = int(doc_tokens * 0.95)          # these words are about one token each
    return [f"Customer {c} agreement.\n" + " ".join(rng.choice(WORDS) for _ in range(words))
            for c in range(customers)]


def run_requests(url: str, model: str, prompts: Sequence[str]) -> list[dict[str, object]]:
    """One request at a time, max_tokens 1: each latency is that request's time to first token."""
    rows = []
    with httpx.Client(timeout=300) as client:
        for prompt in prompts:
            body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
            t0 = time.perf_counter()
            r = client.post(f"{url}/v1/completions", json=body)
            elapsed = time.perf_counter() - t0
            r.raise_for_status()
            usage = r.json()["usage"]
            details = usage.get("prompt_tokens_details") or {}
            rows.append({"ttft_s": elapsed, "prompt_tokens": usage["prompt_tokens"],
                         "cached_tokens": details.get("cached_tokens") or 0,
                         "replica": r.headers.get("x-kvhive-replica"),
                         "reason": r.headers.get("x-kvhive-route-reason")})
    return rows


def summarize(policy: str, rows: list[dict[str, object]]) -> dict[str, object]:
    ttft = sorted(float(r["ttft_s"]) * 1000 for r in rows)
    prompt = sum(int(r["prompt_tokens"]) for r in rows)
    cached = sum(int(r["cached_tokens"]) for r in rows)
    return {"policy": policy, "requests": len(rows), "hit_rate": round(cached / max(prompt, 1), 4),
            "ttft_p50_ms": round(ttft[len(ttft) // 2], 1),
            "ttft_p90_ms": round(ttft[int(0.9 * len(ttft))], 1),
            "ttft_mean_ms": round(statistics.fmean(ttft), 1),
            "reasons": {k: sum(1 for r in rows if r["reason"] == k) for k in {r["reason"] for r in rows}}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--customers", type=int, default=6)
    p.add_argument("--doc-tokens", type=int, default=600)
    p.add_argument("--requests", type=int, default=36)
    p.add_argument("--num-blocks", type=int, default=160, help="KV blocks per replica")
    p.add_argument("--policies", default="kv,round_robin")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "router_real.json"))
    args = p.parse_args()
    docs = make_docs(args.customers, args.doc_tokens, args.seed)
    rng = random.Random(args.seed)
    order = [rng.randrange(args.customers) for _ in range(args.requests)]
    prompts = [f"{docs[c]}\nQuestion {i}: what does it say about {rng.choice(WORDS)}?"
               for i, c in enumerate(order)]
    results = []
    for policy in args.policies.split(","):
        log_dir = tempfile.mkdtemp(prefix="router-real-")
        replicas = [start_kvhive_replica(log_dir, args.num_blocks) for _ in range(2)]
        gateway = None
        try:
            for proc, spec in replicas:
                wait_for(spec.split(",")[0] + "/health", lambda r: r.status_code == 200, 120, "a replica",
                         proc)
            gateway, url = start_gateway(log_dir, [spec for _, spec in replicas], policy)
            time.sleep(0.5)
            rows = run_requests(url, "smollm2-135m", prompts)
        finally:
            stop([gateway, *(proc for proc, _ in replicas)])
        results.append(summarize(policy, rows))
        print(json.dumps(results[-1]), flush=True)
    with open(args.out, "w") as f:
        setup = {k: v for k, v in vars(args).items() if k != "out"}
        json.dump({"machine": machine(), "command": command(__file__), "setup": setup, "results": results},
                  f, indent=1)
    print("\n| policy | requests | KV hit rate | TTFT p50 (ms) | TTFT p90 (ms) | TTFT mean (ms) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['policy']} | {r['requests']} | {100 * r['hit_rate']:.1f}% | {r['ttft_p50_ms']:.0f} | "
              f"{r['ttft_p90_ms']:.0f} | {r['ttft_mean_ms']:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
