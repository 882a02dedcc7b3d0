"""KV-aware routing vs round-robin, random and least-load, on 16-64 simulated replicas.

    python bench/router_sim.py [--replicas 32] [--customers 100] [--doc-tokens 6000] [--rate 30]

For each policy: start ``bench/replica_sim.py`` (N replicas with real KV events) and
``kvhive gateway --policy P`` in front of them, send the same workload, stop both. The workload has
the shape of llm-d's precise-prefix-cache benchmark: many customers, each with a long shared
document, and short unique questions arriving as a Poisson process (customers uniform). Each request
streams; TTFT is measured at the client through the gateway, the cached share of its prompt comes
from ``usage.prompt_tokens_details.cached_tokens``. The first ``--warmup`` requests of the stream
(sent at the same rate) fill the caches and are left out of the figures. Writes a JSON result and a
PNG, and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from router_real import wait_for  # noqa: E402  (bench/ is on sys.path: scripts run from there)
from run_info import command, machine  # noqa: E402

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case "
         "point government company number group problem fact market price contract clause party notice "
         "payment term service customer account order invoice shipment product warranty policy claim "
         "report record data system network server storage region cluster engine model request answer "
         "question river mountain valley forest ocean garden castle bridge tower harbor").split()


@dataclass
class PolicyResult:
    policy: str
    requests: int
    errors: int
    hit_rate: float            # cached prompt tokens / prompt tokens
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    ttft_mean_ms: float
    e2e_p50_ms: float
    wall_s: float


def free_base(count: int) -> int:
    """A base port with ``count`` consecutive free ports after it."""
    rng = random.Random(os.getpid() + time.time_ns())
    for _ in range(200):
        base = rng.randrange(10000, 30000 - count)   # below the ephemeral range
        try:
            for p in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port range")


def make_docs(customers: int, doc_tokens: int, seed: int) -> list[str]:
    """One long document per customer, about ``doc_tokens`` tokens with the default tokenizer."""
    from kvhive.core.model_files import default_model_path
    from kvhive.core.tokenizer import Tokenizer

    tok = Tokenizer.from_model_path(default_model_path())
    rng = random.Random(seed)
    probe = " ".join(rng.choice(WORDS) for _ in range(2000))
    words = int(2000 * doc_tokens / len(tok.encode(probe)))
    return [f"Customer {c} contract.\n" + " ".join(rng.choice(WORDS) for _ in range(words))
            for c in range(customers)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int,
                      out: list[tuple[float, float, int, int]] | None, errors: list[str]) -> None:
    body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft = None
    usage = None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                errors.append(f"{response.status_code}: {(await response.aread())[:200]!r}")
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and ttft is None:
                    ttft = time.perf_counter() - start
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except httpx.HTTPError as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
        return
    if ttft is None or usage is None:
        errors.append("no token or no usage")
        return
    if out is None:        # a warm-up request
        return
    out.append((ttft, time.perf_counter() - start, usage["prompt_tokens"],
                usage["prompt_tokens_details"]["cached_tokens"]))


async def run_workload(gateway: str, docs: list[str], args: argparse.Namespace,
                       direct: list[str] | None = None) -> tuple[list, list, float]:
    """Send the request stream to ``gateway``; or, with ``direct`` replica URLs, each customer's
    requests straight to one replica (``customer % N``: the oracle affinity, no gateway)."""
    rng = random.Random(args.seed)
    out: list[tuple[float, float, int, int]] = []
    errors: list[str] = []
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=500)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        tasks = []
        start = time.perf_counter()
        next_at = start
        for i in range(args.requests):
            customer = rng.randrange(len(docs))
            question = " ".join(rng.choice(WORDS) for _ in range(args.query_words))
            prompt = f"{docs[customer]}\n\nQuestion {i}: {question}?"
            next_at += rng.expovariate(args.rate)
            delay = next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            sink = out if i >= args.warmup else None
            target = direct[customer % len(direct)] if direct else gateway
            tasks.append(asyncio.create_task(one_request(client, f"{target}/v1/completions", prompt,
                                                         args.max_tokens, sink, errors)))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    return out, errors, wall


def run_policy(policy: str, docs: list[str], args: argparse.Namespace) -> PolicyResult:
    from replica_sim import replica_specs

    base = free_base(3 * args.replicas + 1)
    http_base, events_base, gw_port = base, base + args.replicas, base + 3 * args.replicas
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    logs = tempfile.mkdtemp(prefix="router-sim-")
    sim_cmd = [sys.executable, os.path.join(REPO, "bench", "replica_sim.py"),
               "--replicas", str(args.replicas),
               "--port", str(http_base), "--events-port", str(events_base),
               "--capacity-blocks", str(args.capacity_blocks),
               "--prefill-ms-per-token", str(args.prefill_ms_per_token),
               "--decode-ms-per-token", str(args.decode_ms_per_token),
               "--max-running", str(args.max_running)]
    sim = subprocess.Popen(sim_cmd, stdout=open(f"{logs}/sim.log", "w"), stderr=subprocess.STDOUT,
                           env=env, cwd=REPO)
    gateway = None
    try:
        for i in range(args.replicas):
            wait_for(f"http://127.0.0.1:{http_base + i}/health", lambda r: r.status_code == 200, 60,
                     "simulated replicas")
        profile = ["-m", "cProfile", "-o", args.profile_gateway] if args.profile_gateway else []
        if policy == "oracle":
            direct = [f"http://127.0.0.1:{http_base + i}" for i in range(args.replicas)]
            out, errors, wall = asyncio.run(run_workload("", docs, args, direct))
            return summarize(policy, out, errors, wall)
        gw_cmd = [sys.executable, *profile, "-m", "kvhive.cli", "gateway", "--port", str(gw_port),
                  "--policy", policy, "--health-interval", str(args.health_interval),
                  "--log-level", "warning"]
        for spec in replica_specs(args.replicas, http_base, events_base):
            gw_cmd += ["--replica", spec]
        gateway = subprocess.Popen(gw_cmd, stdout=open(f"{logs}/gateway.log", "w"), stderr=subprocess.STDOUT,
                                   env=env, cwd=REPO)
        url = f"http://127.0.0.1:{gw_port}"
        wait_for(f"{url}/health", lambda r: r.status_code == 200
                 and set(r.json()["replicas"].values()) == {"up"}, 60, "the gateway")
        time.sleep(1.0)     # event subscribers connected
        out, errors, wall = asyncio.run(run_workload(url, docs, args))
    finally:
        for proc in (gateway, sim):
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    return summarize(policy, out, errors, wall)


def summarize(policy: str, out: list, errors: list, wall: float) -> PolicyResult:
    if errors:
        print(f"  {policy}: {len(errors)} errors, first: {errors[0]}", file=sys.stderr)
    ttft = [o[0] * 1000 for o in out]
    prompt_tokens = sum(o[2] for o in out)
    return PolicyResult(policy, len(out), len(errors), sum(o[3] for o in out) / max(prompt_tokens, 1),
                        percentile(ttft, 0.5), percentile(ttft, 0.9), percentile(ttft, 0.99),
                        statistics.fmean(ttft) if ttft else float("nan"),
                        percentile([o[1] * 1000 for o in out], 0.5), wall)


def plot(results: list[PolicyResult], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.policy for r in results]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    x = range(len(results))
    ax1.bar([i - 0.2 for i in x], [r.ttft_p50_ms for r in results], 0.4, label="p50")
    ax1.bar([i + 0.2 for i in x], [r.ttft_p90_ms for r in results], 0.4, label="p90")
    ax1.set_xticks(list(x), names)
    ax1.set_ylabel("TTFT (ms)")
    ax1.set_yscale("log")
    ax1.legend()
    ax2.bar(list(x), [100 * r.hit_rate for r in results], color="tab:green")
    ax2.set_xticks(list(x), names)
    ax2.set_ylabel("prompt tokens served from KV cache (%)")
    ax2.set_ylim(0, 100)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=32)
    p.add_argument("--customers", type=int, default=100)
    p.add_argument("--doc-tokens", type=int, default=6000)
    p.add_argument("--query-words", type=int, default=40)
    p.add_argument("--rate", type=float, default=10.0, help="requests per second (Poisson)")
    p.add_argument("--requests", type=int, default=850, help="requests sent, warm-up included")
    p.add_argument("--warmup", type=int, default=250,
                   help="the first requests of the stream, left out of the figures")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--capacity-blocks", type=int, default=8192, help="KV blocks per replica")
    p.add_argument("--prefill-ms-per-token", type=float, default=0.2)
    p.add_argument("--decode-ms-per-token", type=float, default=25.0)
    p.add_argument("--max-running", type=int, default=16)
    p.add_argument("--policies", default="kv,round_robin,random,least_load")
    p.add_argument("--health-interval", type=float, default=1.0, help="the gateway's polling period")
    p.add_argument("--profile-gateway", default=None, help="write a cProfile of the gateway here")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "router_sim.json"))
    p.add_argument("--png", default=os.path.join(REPO, "docs", "router_sim.png"))
    args = p.parse_args()
    docs = make_docs(args.customers, args.doc_tokens, args.seed)
    results = []
    for policy in args.policies.split(","):
        print(f"policy {policy} ...", flush=True)
        results.append(run_policy(policy, docs, args))
        r = results[-1]
        print(f"  hit {100 * r.hit_rate:.1f}%  TTFT p50 {r.ttft_p50_ms:.0f} ms  p90 {r.ttft_p90_ms:.0f} ms  "
              f"p99 {r.ttft_p99_ms:.0f} ms  ({r.requests} ok, {r.errors} errors, {r.wall_s:.0f} s)",
              flush=True)
    setup = {k: v for k, v in vars(args).items() if k not in ("out", "png")}
    with open(args.out, "w") as f:
        json.dump({"machine": machine(), "command": command(__file__), "setup": setup,
                   "results": [asdict(r) for r in results]}, f, indent=1)
    title = (f"{args.replicas} simulated replicas, {args.customers} customers x "
             f"{args.doc_tokens}-token docs, "
             f"{args.rate:g} req/s Poisson, {args.capacity_blocks} KV blocks/replica")
    plot(results, args.png, title)
    print("\n| policy | requests | KV hit rate | TTFT p50 (ms) | TTFT p90 (ms) | TTFT p99 (ms) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r.policy} | {r.requests} | {100 * r.hit_rate:.1f}% | {r.ttft_p50_ms:.0f} | "
              f"{r.ttft_p90_ms:.0f} | {r.ttft_p99_ms:.0f} |")
    base = next((r for r in results if r.policy == "round_robin"), None)
    kv = next((r for r in results if r.policy == "kv"), None)
    if base and kv:
        print(f"\nP90 TTFT, round-robin / kv: {base.ttft_p90_ms / kv.ttft_p90_ms:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
