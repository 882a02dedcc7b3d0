#!/usr/bin/env python3
"""Run the shared multi-turn workload against kvhive and vLLM for CPU in one session.

For each server: start it, run ``../shared/bench/multiturn.py`` cold and warm at concurrency 1
and 8, stop it. Then write one result file, ``bench/results/multiturn_<tag>.json`` (machine,
command, each run's summary and median TTFT per turn), and a PNG of TTFT per turn,
``docs/ttft_per_turn_<tag>.png``; ``python bench/report.py`` turns the result into
docs/benchmarks.md. The tag names the comparison: float32 (the default), bf16, smallkv, avx2.

    python bench/multiturn_vs_vllm.py --rounds 2      # kvhive float32 + vLLM float32
    python bench/multiturn_vs_vllm.py --skip-vllm     # reuse vLLM runs already in --work-dir
    python bench/multiturn_vs_vllm.py --kvhive-args "--dtype bfloat16" --vllm-dtype bfloat16 --tag bf16
    python bench/multiturn_vs_vllm.py --rounds 3      # kvhive, vLLM, vLLM, kvhive, kvhive, vLLM

On a shared host the neighbours' load moves both servers' figures from one run to the next, so
--rounds runs the pair back to back several times and the targets use the median paired ratio.

vLLM is installed by ``../shared/peers/vllm.sh install`` (after ``make_model.sh``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

from run_info import command, machine

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SHARED = os.environ.get("KVHIVE_SHARED", os.path.join(ROOT, "..", "shared"))
WORKLOAD = os.path.join(SHARED, "bench", "multiturn.py")
VLLM_SH = os.path.join(SHARED, "peers", "vllm.sh")
RUNS = [("cold", 1), ("warm", 1), ("warm", 8), ("cold", 8)]


def wait_up(port: int, proc: subprocess.Popen, timeout: float = 900) -> float:
    """Poll /v1/models until the server answers; return seconds waited."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).read()
            return time.time() - t0
        except OSError:
            time.sleep(1)
    raise TimeoutError("server did not come up")


def run_workload(port: int, name: str, out_dir: str, extra: list[str],
                 runs: list[tuple[str, int]] = RUNS) -> None:
    """The workload runs (mode, concurrency) against one live server."""
    for mode, conc in runs:
        out = os.path.join(out_dir, f"{name}_{mode}_c{conc}.json")
        cmd = [sys.executable, WORKLOAD, "--base-url", f"http://127.0.0.1:{port}/v1",
               "--model", "smollm2-135m", "--mode", mode, "--concurrency", str(conc),
               "--label", f"{name} {mode} c{conc}", "--out", out, *extra]
        print("+", shlex.join(cmd), flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


@contextlib.contextmanager
def served(cmd: list[str], port: int, log: str, env: dict | None = None) -> Iterator[subprocess.Popen]:
    """A server started (output to ``log``) and answering on ``port``; stopped on leaving."""
    print("+", shlex.join(cmd), flush=True)
    with open(log, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            print(f"up after {wait_up(port, proc):.0f}s", flush=True)
            yield proc
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 15)
            proc.wait(timeout=120)


def serve_and_run(cmd: list[str], port: int, name: str, out_dir: str, log: str,
                  extra: list[str], env: dict | None = None,
                  runs: list[tuple[str, int]] = RUNS) -> None:
    """Start a server, run the workload, stop the server."""
    print("+", shlex.join(cmd), flush=True)
    with open(log, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            print(f"{name} up after {wait_up(port, proc):.0f}s", flush=True)
            run_workload(port, name, out_dir, extra, runs)
        finally:
            os.killpg(proc.pid, 15)
            proc.wait(timeout=60)


def load(out_dir: str, name: str, mode: str, conc: int) -> dict | None:
    """A raw run file's summary and records, or None."""
    path = os.path.join(out_dir, f"{name}_{mode}_c{conc}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def ttft_by_turn(records: list[dict]) -> list[float]:
    """Median TTFT (ms) of each turn."""
    by: dict[int, list[float]] = {}
    for r in records:
        if r["ttft_s"] is not None:
            by.setdefault(r["turn"], []).append(r["ttft_s"] * 1000)
    return [sorted(v)[len(v) // 2] for _, v in sorted(by.items())]


def collect(out_dir: str, pairs: list[tuple[str, str]]) -> list[dict[str, dict[str, dict]]]:
    """One entry per round: {"kvhive"|"vllm": {"<mode>_c<conc>": summary + ttft_by_turn_ms}}."""
    rounds = []
    for pair in pairs:
        entry: dict[str, dict[str, dict]] = {}
        for server, name in zip(("kvhive", "vllm"), pair, strict=True):
            for mode, conc in RUNS:
                res = load(out_dir, name, mode, conc)
                if res is not None:
                    summary = {k: v for k, v in res["summary"].items() if k != "label"}
                    entry.setdefault(server, {})[f"{mode}_c{conc}"] = {
                        **summary, "ttft_by_turn_ms": ttft_by_turn(res["records"])}
        rounds.append(entry)
    return rounds


def plot(result: dict, png: str) -> None:
    """TTFT per turn, warm and cold, concurrency 1, one line per server and round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, mode in zip(axes, ("warm", "cold"), strict=True):
        for i, entry in enumerate(result["rounds"], 1):
            for server, runs in entry.items():
                run = runs.get(f"{mode}_c1")
                if run and run.get("ttft_by_turn_ms"):
                    ys = run["ttft_by_turn_ms"]
                    ax.plot(range(1, len(ys) + 1), ys, marker="o", label=f"{server} round {i}")
        ax.set_title(f"{mode}: median TTFT per turn (concurrency 1)")
        ax.set_xlabel("turn")
        ax.set_ylabel("TTFT (ms)")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def fmt(v, scale=1000.0, digits=0) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def table(result: dict) -> list[str]:
    """Markdown rows of every run's summary."""
    rows = ["| server | round | mode | conc | TTFT turn 1 (ms) | TTFT turns 2-4 (ms) | "
            "decode (ms/token) | cached fraction | completion tok/s | wall (s) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for i, entry in enumerate(result["rounds"], 1):
        for server, runs in entry.items():
            for run, s in runs.items():
                mode, conc = run.split("_c")
                rows.append(f"| {server} | {i} | {mode} | {conc} | "
                            f"{fmt(s['median_ttft_turn1_excl_first_s'])} | "
                            f"{fmt(s['median_ttft_turns2to4_s'])} | "
                            f"{fmt(s['median_decode_ms_per_tok'], 1, 1)} | "
                            f"{fmt(s['cached_fraction'], 1, 2)} | "
                            f"{s['throughput_completion_tok_s']:.1f} | {s['wall_s']:.1f} |")
    return rows


# The targets, as (label, mode, concurrency, summary key, scale, comparison, goal) per goal set:
# the engine's, a device KV budget too small for the workload, and an AVX2-only CPU's.
GOALS = {
    "engine": [("warm TTFT turns 2-4 (ms)", "warm", 1, "median_ttft_turns2to4_s", 1000, "<=", 0.7),
               ("cold turn-1 TTFT (ms)", "cold", 1, "median_ttft_turn1_excl_first_s", 1000, "<=", 1.0),
               ("decode ms/token (warm, c1)", "warm", 1, "median_decode_ms_per_tok", 1, "<=", 0.75),
               ("completion tok/s (warm, c8)", "warm", 8, "throughput_completion_tok_s", 1, ">=", 1.2)],
    "smallkv": [("warm TTFT turns 2-4 (ms)", "warm", 1, "median_ttft_turns2to4_s", 1000, "<=", 0.5),
                ("warm TTFT turns 2-4, concurrency 8 (ms)", "warm", 8, "median_ttft_turns2to4_s", 1000,
                 "<=", 0.5)],
    "avx2": [("warm TTFT turns 2-4 (ms)", "warm", 1, "median_ttft_turns2to4_s", 1000, "<=", 0.7),
             ("cold turn-1 TTFT (ms)", "cold", 1, "median_ttft_turn1_excl_first_s", 1000, "<=", 1.0),
             ("decode ms/token (warm, c1)", "warm", 1, "median_decode_ms_per_tok", 1, "<=", 0.6),
             ("completion tok/s (warm, c8)", "warm", 8, "throughput_completion_tok_s", 1, ">=", 1.3)],
}


def ratios(result: dict) -> list[str]:
    """The target ratios, ours / peer, of each round (a kvhive run and a vLLM run back to back) and
    their median, which decides 'met': on a shared host the two servers of one round see the same
    neighbours, so paired ratios are steadier than either server's own figures."""
    lines = ["| target | kvhive (median) | vLLM (median) | ratio per round | median ratio | goal | met |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for label, mode, conc, key, scale, op, goal in GOALS[result["goals"]]:
        run = f"{mode}_c{conc}"
        got = [(e["kvhive"][run][key], e["vllm"][run][key]) for e in result["rounds"]
               if run in e.get("kvhive", {}) and run in e.get("vllm", {})]
        if not got:
            continue
        per_round = [a / b for a, b in got]
        r = statistics.median(per_round)
        met = r <= goal if op == "<=" else r >= goal
        lines.append(f"| {label} | {statistics.median(a for a, _ in got) * scale:.1f} | "
                     f"{statistics.median(b for _, b in got) * scale:.1f} | "
                     f"{', '.join(f'{x:.2f}x' for x in per_round)} | {r:.2f}x | {op} {goal}x | "
                     f"{'yes' if met else 'no'} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="the result file (default: bench/results/multiturn_<tag>.json)")
    ap.add_argument("--plot", default=None, help="default: docs/ttft_per_turn_<tag>.png")
    ap.add_argument("--work-dir", default=os.path.join(HERE, "out", "multiturn"),
                    help="each run's raw workload output and the servers' logs")
    ap.add_argument("--kvhive-args", default="", help="extra arguments for kvhive serve")
    ap.add_argument("--tag", default="float32", help="suffix of the kvhive run names")
    ap.add_argument("--vllm-dtype", default="float32")
    ap.add_argument("--vllm-args", default="", help="extra vLLM server flags (VLLM_EXTRA)")
    ap.add_argument("--vllm-tag", default="", help="suffix of the vLLM run names")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-kvhive", action="store_true")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--runs", default="cold:1,warm:1,warm:8,cold:8",
                    help="mode:concurrency pairs to run (default: all four)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run kvhive and vLLM back to back this many times (alternating who goes first); "
                         "the targets use the median of the rounds' paired ratios")
    ap.add_argument("--goals", choices=sorted(GOALS), default="engine",
                    help="which targets to print: engine, smallkv (a small device KV budget) or avx2 "
                         "(an AVX2-only CPU)")
    args = ap.parse_args()
    out = args.out or os.path.join(HERE, "results", f"multiturn_{args.tag}.json")
    png = args.plot or os.path.join(ROOT, "docs", f"ttft_per_turn_{args.tag}.png")
    os.makedirs(args.work_dir, exist_ok=True)
    runs = [(m, int(c)) for m, c in (r.split(":") for r in args.runs.split(","))]
    ours, peer = f"kvhive_{args.tag}", f"vllm_{args.vllm_dtype}{args.vllm_tag}"
    pairs = [(ours, peer)] if args.rounds == 1 else [
        (f"{ours}_r{i}", f"{peer}_r{i}") for i in range(1, args.rounds + 1)]
    for i, (our_name, peer_name) in enumerate(pairs):
        servers = []
        if not args.skip_kvhive:
            cmd = [sys.executable, "-m", "kvhive.cli", "serve", "--port", str(args.port),
                   *shlex.split(args.kvhive_args)]
            servers.append((cmd, our_name, None))
        if not args.skip_vllm:
            cmd = ["bash", VLLM_SH, "serve", args.vllm_dtype, str(args.port)]
            servers.append((cmd, peer_name, dict(os.environ, VLLM_EXTRA=args.vllm_args)))
        for cmd, name, env in servers if i % 2 == 0 else servers[::-1]:   # alternate who goes first
            serve_and_run(cmd, args.port, name, args.work_dir, os.path.join(args.work_dir, f"{name}.log"), [],
                          env=env, runs=runs)
    result = {"machine": machine(), "date": time.strftime("%Y-%m-%d"),
              "command": command(__file__),
              "goals": args.goals,
              "peer": f"vLLM for CPU 0.32.0, {args.vllm_dtype}"
                      + (f", VLLM_EXTRA='{args.vllm_args}'" if args.vllm_args else "")
                      + (", torch and oneDNN held to AVX2" if os.environ.get("DNNL_MAX_CPU_ISA", "").upper() == "AVX2"
                         else ""),
              "rounds": collect(args.work_dir, pairs)}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, png)
    print("\n".join(table(result) + [""] + ratios(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
