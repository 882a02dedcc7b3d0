#!/usr/bin/env python3
"""kvhive and vLLM for CPU on a quiet host and beside a process that burns one core, paired.

For each server: start it, then alternate quiet and loaded runs of a short multi-turn workload
(``../shared/bench/multiturn.py --mode warm``: a 1,500-token shared system prompt, a few
conversations of three turns, 32 output tokens each); a loaded run starts a busy-looping process
first and stops it after. Reports decode ms/token and warm TTFT (turns 2-3) per server, quiet and
loaded, and each server's loaded/quiet slowdown (medians over rounds).

    python bench/contention.py                                   # kvhive defaults vs vLLM float32
    python bench/contention.py --kvhive-args "--omp-wait-policy active" --skip-vllm --tag spin
    python bench/contention.py --env DNNL_MAX_CPU_ISA=AVX2 --kvhive-args "--cpu-isa avx2" --tag avx2

Writes ``bench/results/contention.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from multiturn_vs_vllm import VLLM_SH, WORKLOAD, wait_up  # noqa: E402
from run_info import machine  # noqa: E402

BURNER = "import time\nwhile True:\n    pass\n"


def run_once(port: int, out: str, convs: int) -> dict:
    """One short warm workload run; its summary."""
    cmd = [sys.executable, WORKLOAD, "--base-url", f"http://127.0.0.1:{port}/v1", "--model", "smollm2-135m",
           "--mode", "warm", "--convs", str(convs), "--turns", "3", "--out", out]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)["summary"]


def measure(cmd: list[str], env: dict, port: int, rounds: int, convs: int, tmp: str, log: str) -> dict:
    """Start one server and run quiet/loaded pairs ``rounds`` times; the medians per state."""
    print("+", shlex.join(cmd), flush=True)
    got: dict[str, list[dict]] = {"quiet": [], "loaded": []}
    with open(log, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            print(f"up after {wait_up(port, proc):.0f}s", flush=True)
            run_once(port, os.path.join(tmp, "warmup.json"), 1)
            for r in range(rounds):
                for state in (("quiet", "loaded") if r % 2 == 0 else ("loaded", "quiet")):
                    burner = subprocess.Popen([sys.executable, "-c", BURNER]) if state == "loaded" else None
                    try:
                        time.sleep(0.5 if burner else 0)
                        s = run_once(port, os.path.join(tmp, f"{state}_{r}.json"), convs)
                    finally:
                        if burner:
                            burner.kill()
                            burner.wait()
                    got[state].append(s)
                    print(f"  round {r + 1} {state}: decode {s['median_decode_ms_per_tok']:.1f} ms/token, "
                          f"warm TTFT {s['median_ttft_turns2to4_s'] * 1000:.0f} ms", flush=True)
        finally:
            os.killpg(proc.pid, 15)
            proc.wait(timeout=60)

    def med(state: str, key: str, scale: float) -> float:
        return statistics.median(s[key] for s in got[state]) * scale

    return {state: {"decode_ms_per_token": med(state, "median_decode_ms_per_tok", 1),
                    "warm_ttft_ms": med(state, "median_ttft_turns2to4_s", 1000)} for state in got}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvhive-args", default="", help="extra arguments for kvhive serve")
    ap.add_argument("--vllm-dtype", default="float32")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="environment for both servers (e.g. DNNL_MAX_CPU_ISA=AVX2); repeatable")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--convs", type=int, default=3, help="conversations per run (3 turns each)")
    ap.add_argument("--port", type=int, default=8124)
    ap.add_argument("--tag", default="", help="suffix of the result file name")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ, **dict(e.split("=", 1) for e in args.env))
    servers = [("kvhive", [sys.executable, "-m", "kvhive.cli", "serve", "--port", str(args.port),
                           *shlex.split(args.kvhive_args)])]
    if not args.skip_vllm:
        servers.append(("vllm", ["bash", VLLM_SH, "serve", args.vllm_dtype, str(args.port)]))
    results = {}
    tmp = os.path.join(args.out, ".contention")
    os.makedirs(tmp, exist_ok=True)
    for name, cmd in servers:
        results[name] = measure(cmd, env, args.port, args.rounds, args.convs, tmp,
                                os.path.join(tmp, f"{name}.log"))
    rows = ["| server | decode quiet (ms/token) | decode loaded | slowdown | warm TTFT quiet (ms) | "
            "warm TTFT loaded | slowdown |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in results.items():
        q, lo = r["quiet"], r["loaded"]
        rows.append(f"| {name} | {q['decode_ms_per_token']:.1f} | {lo['decode_ms_per_token']:.1f} | "
                    f"{lo['decode_ms_per_token'] / q['decode_ms_per_token']:.2f}x | {q['warm_ttft_ms']:.0f} | "
                    f"{lo['warm_ttft_ms']:.0f} | {lo['warm_ttft_ms'] / q['warm_ttft_ms']:.2f}x |")
    record = {"machine": machine(), "command": "python bench/contention.py " + shlex.join(sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d"), "results": results, "table": "\n".join(rows)}
    name = f"contention{'_' + args.tag if args.tag else ''}.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(record, f, indent=1)
    print(record["machine"])
    print(record["table"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
