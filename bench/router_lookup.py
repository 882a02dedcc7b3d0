"""Block-index lookup latency (1M blocks, in memory and in Redis) and the gateway's per-request overhead.

    python bench/router_lookup.py [--blocks 1000000] [--replicas 32] [--lookups 2000]

1. In memory: an ``InMemoryIndex`` holding ``--blocks`` block keys (chains of ``--chain-blocks``
   blocks spread over ``--replicas`` replicas). Timed: ``lookup`` of one prompt's keys (a whole
   chain: the longest a lookup gets), and the gateway's whole scoring step for a token-id prompt
   (hash the blocks, look them up, score).
2. Redis: the same through ``RedisIndex`` on a ``redis-server`` this script starts on a free port.
3. Gateway overhead: a simulated replica with zero costs, asked directly and through ``kvhive
   gateway`` (KV policy, events on), one request at a time; the difference of the medians. Also the
   CPU time the gateway's event-loop thread spends per request (``/proc/PID/task/PID/schedstat``,
   nanoseconds on a CPU), which a loaded machine inflates less than wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from router_real import wait_for  # noqa: E402
from run_info import command, machine  # noqa: E402

from kvhive.core.blocks import hash_blocks, root_hash  # noqa: E402
from kvhive.routing.index import InMemoryIndex, RedisIndex  # noqa: E402

BLOCK = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(values_s: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values_s]
    return {"p50_ms": round(pct(ms, 0.5), 4), "p99_ms": round(pct(ms, 0.99), 4),
            "mean_ms": round(statistics.fmean(ms), 4)}


def chains(num_blocks: int, chain_blocks: int, seed: int) -> list[tuple[list[int], list[bytes]]]:
    """Token ids and kvhive keys of ``num_blocks / chain_blocks`` distinct prompts."""
    rng = random.Random(seed)
    root = root_hash(0, "bench")
    out = []
    for c in range(num_blocks // chain_blocks):
        ids = [c] + [rng.randrange(49152) for _ in range(chain_blocks * BLOCK - 1)]
        out.append((ids, hash_blocks(ids, BLOCK, root)))
    return out


def fill(index, prompts, replicas: int, batch: int = 400) -> float:
    start = time.perf_counter()
    for i, (_, keys) in enumerate(prompts):
        replica = f"http://replica-{i % replicas}:8000"
        for j in range(0, len(keys), batch):
            index.add(keys[j:j + batch], replica, "GPU")
    return time.perf_counter() - start


def time_lookups(index, prompts, lookups: int, seed: int) -> dict[str, object]:
    from kvhive.routing.scorer import LongestPrefixMatch, TierWeights

    rng = random.Random(seed)
    root = root_hash(0, "bench")
    scorer, tiers = LongestPrefixMatch(), TierWeights()
    lookup_s, cpu_s, score_s, hits = [], [], [], 0
    for _ in range(lookups):
        ids, keys = prompts[rng.randrange(len(prompts))]
        c0, t0 = time.thread_time(), time.perf_counter()
        found = index.lookup(keys)
        t1, c1 = time.perf_counter(), time.thread_time()
        lookup_s.append(t1 - t0)
        cpu_s.append(c1 - c0)
        hits += len(found) == len(keys)
        # The gateway's scoring step for a token-id prompt: hash, look up, score.
        t0 = time.perf_counter()
        scorer.score(index.lookup(hash_blocks(ids, BLOCK, root)), tiers)
        score_s.append(time.perf_counter() - t0)
    # Wall time includes waiting for a core on a busy machine; this thread's CPU time does not.
    return {"lookup": summary(lookup_s), "lookup_thread_cpu": summary(cpu_s),
            "hash_lookup_score": summary(score_s),
            "full_hits": hits, "lookups": lookups}


def bench_memory(prompts, args) -> dict[str, object]:
    index = InMemoryIndex(max_keys=args.blocks + 1)
    fill_s = fill(index, prompts, args.replicas)
    result = {"keys": len(index), "fill_s": round(fill_s, 2), **time_lookups(index, prompts, args.lookups, 2)}
    return result


def bench_redis(prompts, args) -> dict[str, object]:
    exe = shutil.which("redis-server") or "/usr/bin/redis-server"
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="kvhive-redis-")
    proc = subprocess.Popen([exe, "--port", str(port), "--save", "", "--appendonly", "no", "--dir", workdir],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        import redis

        client = redis.Redis(port=port)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        index = RedisIndex(client=client)
        fill_s = fill(index, prompts, args.replicas)
        keys = client.dbsize()
        memory = client.info("memory")["used_memory"]
        result = {"keys": keys - args.replicas, "fill_s": round(fill_s, 1),
                  "redis_used_mb": round(memory / 2**20), **time_lookups(index, prompts, args.lookups, 3)}
        client.close()
        return result
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


def bench_gateway(args) -> dict[str, object]:
    from replica_sim import replica_specs

    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    sim_port, events_port, gw_port = free_port(), free_port(), free_port()
    while events_port + 1 in (sim_port, gw_port):
        events_port = free_port()
    sim = subprocess.Popen([sys.executable, os.path.join(REPO, "bench", "replica_sim.py"),
                            "--replicas", "1",
                            "--port", str(sim_port), "--events-port", str(events_port),
                            "--prefill-ms-per-token", "0", "--prefill-overhead-ms", "0",
                            "--decode-ms-per-token", "0"], env=env, cwd=REPO,
                           stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    gateways: dict[str, subprocess.Popen[bytes]] = {}
    try:
        direct = f"http://127.0.0.1:{sim_port}"
        wait(f"{direct}/health")
        # The gateway under test, and optionally the same gateway from another checkout, both
        # interleaved with direct requests so that all see the same machine load.
        paths = {"gateway": args.gateway_path, "baseline": args.baseline_path}
        urls = {"direct": direct}
        for label, path in paths.items():
            if label == "baseline" and not path:
                continue
            gw_env = dict(env)
            if path:
                gw_env["PYTHONPATH"] = path + os.pathsep + env["PYTHONPATH"]
            port = gw_port if label == "gateway" else free_port()
            gateways[label] = subprocess.Popen(
                [sys.executable, "-m", "kvhive.cli", "gateway", "--port", str(port),
                 "--replica", replica_specs(1, sim_port, events_port)[0], "--log-level", "warning"],
                env=gw_env, cwd=path or REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
            urls[label] = f"http://127.0.0.1:{port}"
            wait(f"{urls[label]}/health")
        rng = random.Random(4)
        words = "alpha beta gamma delta river mountain valley forest ocean garden castle".split()
        doc = " ".join(rng.choice(words) for _ in range(3500))       # ~3.5k tokens, shared
        out: dict[str, object] = {}
        with httpx.Client(timeout=30) as client:
            for name, make in (("short prompt", lambda i: f"Hello number {i}, how are you?"),
                               ("3.5k-token shared prefix", lambda i: f"{doc}\nQuestion {i}: why?")):
                times: dict[str, list[float]] = {label: [] for label in urls}
                cpu_ns = dict.fromkeys(gateways, 0)
                for i in range(args.gateway_requests + 20):
                    body = {"model": "smollm2-135m", "prompt": make(i), "max_tokens": 1}
                    # Alternate in a shuffled order so all see the same conditions; 20 warm up.
                    order = list(urls.items())
                    rng.shuffle(order)
                    for label, url in order:
                        cpu0 = loop_cpu_ns(gateways[label].pid) if label in gateways else 0
                        t0 = time.perf_counter()
                        r = client.post(f"{url}/v1/completions", json=body)
                        elapsed = time.perf_counter() - t0
                        assert r.status_code == 200, r.text
                        if i >= 20:
                            times[label].append(elapsed)
                            if label in gateways:
                                cpu_ns[label] += loop_cpu_ns(gateways[label].pid) - cpu0
                d = summary(times["direct"])
                out[name] = {label: summary(t) for label, t in times.items()}
                for label in urls:
                    if label != "direct":
                        out[name][f"{label}_overhead_p50_ms"] = round(
                            summary(times[label])["p50_ms"] - d["p50_ms"], 3)
                        out[name][f"{label}_loop_cpu_ms_per_request"] = round(
                            cpu_ns[label] / len(times[label]) / 1e6, 3)
        return out
    finally:
        for proc in (*gateways.values(), sim):
            proc.terminate()
            proc.wait(10)


def loop_cpu_ns(pid: int) -> int:
    """Nanoseconds the main (event-loop) thread of ``pid`` has run on a CPU."""
    with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
        return int(f.read().split()[0])


def wait(url: str, timeout_s: float = 60) -> None:
    wait_for(url, lambda r: r.status_code == 200, timeout_s, url)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, default=1_000_000)
    p.add_argument("--chain-blocks", type=int, default=400, help="blocks per prompt (400 = 6.4k tokens)")
    p.add_argument("--replicas", type=int, default=32)
    p.add_argument("--lookups", type=int, default=2000)
    p.add_argument("--gateway-requests", type=int, default=300)
    p.add_argument("--gateway-path", default=None,
                   help="prepend this to the gateway's PYTHONPATH (e.g. a dir with httptools and uvloop, "
                        "which uvicorn then uses)")
    p.add_argument("--baseline-path", default=None,
                   help="also time a gateway run from this checkout (e.g. a `git worktree` of an older "
                        "commit), interleaved with the one under test")
    p.add_argument("--skip", default="", help="comma list of memory,redis,gateway to leave out")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "router_lookup.json"))
    args = p.parse_args()
    load_before = os.getloadavg()
    skip = set(filter(None, args.skip.split(",")))
    results: dict[str, object] = {"machine": machine(), "command": command(__file__),
                                  "setup": {k: v for k, v in vars(args).items() if k != "out"}}
    prompts = chains(args.blocks, args.chain_blocks, 1) if skip != {"memory", "redis"} else []
    if "memory" not in skip:
        results["memory"] = bench_memory(prompts, args)
        print("in memory:", json.dumps(results["memory"]), flush=True)
    if "redis" not in skip:
        results["redis"] = bench_redis(prompts, args)
        print("redis:", json.dumps(results["redis"]), flush=True)
    if "gateway" not in skip:
        results["gateway_overhead"] = bench_gateway(args)
        print("gateway overhead:", json.dumps(results["gateway_overhead"]), flush=True)
    results["load_average_1m"] = {"start": round(load_before[0], 2), "end": round(os.getloadavg()[0], 2)}
    print("load average (1 min):", results["load_average_1m"], flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
