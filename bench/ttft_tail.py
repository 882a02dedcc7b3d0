#!/usr/bin/env python3
"""First-token tail under Poisson arrivals: kvhive against vLLM for CPU, driven by vLLM's own client.

    python bench/ttft_tail.py --rounds 2 --baseline-args "--long-prefill-token-threshold 0"
                                                  # writes bench/results/ttft_tail.json
    python bench/ttft_tail.py --smoke             # 6 prompts, one rate, one round: checks the plumbing

``vllm bench serve`` (run from the vLLM for CPU install through ``bench/vllm_bench_client.py``)
sends the same requests, at the same seeded Poisson arrival times, to each server in turn:

- ``prefix_repetition``: a few shared 1,024-token prefixes, each request a prefix plus its own
  128-token suffix (what a shared system prompt or document looks like to a server);
- ``random``: 512 random prompt tokens per request, nothing shared.

Both ask for 64 tokens with ``ignore_eos``, float32 on both servers, at most 8 running requests
each. First each server's saturating rate is probed (``--request-rate inf``, up to 8 requests in
flight); the runs then arrive at fractions (``--rates``, default 0.5, 0.7, 0.9) of the lower of the two
servers' saturating rates, so both see the same load. A round runs both servers back to back
(alternating who goes first); the figures compared are kvhive's over vLLM's in the same round,
median over rounds. Targets: P90 and P99 TTFT <= 1.0x vLLM's at every rate. With
``--baseline-args``, kvhive also runs with those arguments in each round (after the pair), so its
median TTFT and ITL can be compared with a scheduler setting's (``--long-prefill-token-threshold 0``:
the schedule before long prefills were chunked).

    python bench/ttft_tail.py --extend bench/results/ttft_tail.json --rounds 1 --datasets random
                                                  # one more paired round of random's runs

``--extend RESULT`` adds ``--rounds`` rounds of ``--datasets`` to a recorded result, at its
saturating rates and the ``--rates`` fractions (its keys), with its baseline configuration if it
has one, and recomputes its ratios (each run's median over the rounds that ran it). Each added
round first probes both servers' saturating rates again on the machine it runs on and records, per
run, the fraction of that machine's (lower) saturating rate it arrived at (``load``): a round on a
slower machine runs the recorded rates closer to its own saturation, and says so.

vLLM is installed by ``../shared/peers/vllm.sh install`` (after ``make_model.sh``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import zlib
from collections.abc import Callable

from multiturn_vs_vllm import SHARED, VLLM_SH, served
from run_info import command, machine

HERE = os.path.dirname(os.path.abspath(__file__))
PEERS = os.environ.get("PEERS_DIR", os.path.join(os.path.expanduser("~"), ".cache", "kvhive-peers"))
VLLM_PYTHON = os.path.join(PEERS, "vllm", "bin", "python")
TOKENIZER = os.path.join(PEERS, "models", "smollm2-135m")
DATASETS = {
    "prefix_repetition": ["--prefix-repetition-prefix-len", "1024", "--prefix-repetition-suffix-len", "128",
                          "--prefix-repetition-num-prefixes", "4", "--prefix-repetition-output-len", "64"],
    "random": ["--random-input-len", "512", "--random-output-len", "64"],
}
BASELINE = "kvhive_baseline"
BASELINE_METRICS = ("median_ttft_ms", "median_itl_ms", "p90_ttft_ms", "p99_ttft_ms")
METRICS = ("median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "mean_ttft_ms", "median_itl_ms", "p99_itl_ms")


def bench_serve(port: int, dataset: str, rate: float, num_prompts: int, seed: int, out: str) -> dict:
    """One ``vllm bench serve`` run against the server on ``port``; its saved result."""
    cmd = [VLLM_PYTHON, os.path.join(HERE, "vllm_bench_client.py"), "bench", "serve",
           "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions",
           "--model", "smollm2-135m", "--tokenizer", TOKENIZER, "--dataset-name", dataset, *DATASETS[dataset],
           "--num-prompts", str(num_prompts), "--request-rate", "inf" if rate == float("inf") else f"{rate:.4f}",
           "--max-concurrency", "8", "--seed", str(seed), "--ignore-eos",
           "--percentile-metrics", "ttft,itl", "--metric-percentiles", "50,90,99",
           "--save-result", "--result-dir", os.path.dirname(out), "--result-filename", os.path.basename(out)]
    print("+", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    with open(out) as f:
        return json.load(f)


def server_command(name: str, port: int, kvhive_args: list[str]) -> tuple[list[str], dict | None]:
    """How to start ``name`` (kvhive, kvhive_baseline or vllm) on ``port``, and its environment."""
    if name.startswith("kvhive"):
        return [sys.executable, "-m", "kvhive.cli", "serve", "--port", str(port), "--dtype", "float32",
                "--max-num-seqs", "8", *kvhive_args], None
    return ["bash", VLLM_SH, "serve", "float32", str(port)], dict(os.environ)


def summary(result: dict) -> dict:
    """The figures this benchmark compares, from one saved run."""
    return {"request_throughput": result.get("request_throughput"),
            "completed": result.get("completed"), **{m: result.get(m) for m in METRICS}}


def run_server(name: str, args: argparse.Namespace, plan: list[tuple[str, float]], tag: str,
               then: Callable[[dict], list[tuple[str, float]]] | None = None) -> dict:
    """Start ``name``, run ``plan`` ((dataset, rate) pairs; rate inf = the saturation probe), then
    the plan ``then(runs so far)`` makes, when given; stop it."""
    extra = args.baseline_args if name == BASELINE else args.kvhive_args
    cmd, env = server_command(name, args.port, extra.split())
    runs: dict[str, dict] = {}
    with served(cmd, args.port, os.path.join(args.work_dir, f"{name}_{tag}.log"), env):
        run_plan(name, args, plan, tag, runs)
        if then is not None:
            run_plan(name, args, then(runs), tag, runs)
    return runs


def run_plan(name: str, args: argparse.Namespace, plan: list[tuple[str, float]], tag: str, runs: dict) -> None:
    """The runs of ``plan`` against the live server, their summaries added to ``runs``."""
    for dataset, rate in plan:
        key = f"{dataset}@{'sat' if rate == float('inf') else f'{rate:.3f}'}"
        out = os.path.join(args.work_dir, f"{name}_{tag}_{key}.json")
        seed = zlib.crc32(key.encode()) % 100_000      # the same prompts and arrivals for both servers
        runs[key] = summary(bench_serve(args.port, dataset, rate, args.num_prompts, seed, out))


def saturating_rates(datasets: list[str], *probes: dict) -> dict[str, float]:
    """Per dataset, the lower of the servers' request throughputs with requests always waiting."""
    return {d: min(p[f"{d}@sat"]["request_throughput"] for p in probes) for d in datasets}


def rates_plan(datasets: list[str], fractions: list[float], *probes: dict) -> list[tuple[str, float]]:
    """(dataset, request rate) runs: each fraction of the dataset's saturating rate."""
    saturating = saturating_rates(datasets, *probes)
    return [(d, f * saturating[d]) for d in datasets for f in fractions]


def loads(plan: list[tuple[str, float]], *probes: dict) -> dict[str, float]:
    """Per run of ``plan``, its rate over the lower saturating rate ``probes`` measured."""
    saturating = saturating_rates(list(dict.fromkeys(d for d, _ in plan)), *probes)
    return {f"{d}@{rate:.3f}": round(rate / saturating[d], 3) for d, rate in plan}


def run_keys(rounds: list[dict]) -> list[str]:
    """Every run any round has (not the probes), in the order they first appear."""
    return list(dict.fromkeys(k for r in rounds for k in r["kvhive"] if not k.endswith("@sat")))


def paired(rounds: list[dict], key: str, over: str = "vllm") -> list[dict]:
    """The rounds in which both kvhive and ``over`` ran ``key``."""
    return [r for r in rounds if key in r["kvhive"] and key in r.get(over, {})]


def ratios(rounds: list[dict], over: str = "vllm", metrics: tuple[str, ...] = METRICS) -> dict:
    """kvhive / ``over`` (vllm, or the kvhive baseline) per run and metric, the median over the
    rounds that ran it."""
    out: dict[str, dict[str, float]] = {}
    for key in run_keys(rounds):
        per_metric = {}
        for m in metrics:
            values = [r["kvhive"][key][m] / r[over][key][m] for r in paired(rounds, key, over)
                      if r["kvhive"][key].get(m) and r[over][key].get(m)]
            if values:
                per_metric[m] = round(statistics.median(values), 3)
        out[key] = per_metric
    return out


def extend(args: argparse.Namespace, datasets: list[str], fractions: list[float]) -> dict:
    """``args.extend``'s result with ``args.rounds`` more rounds of ``datasets`` (module docstring)."""
    with open(args.extend) as f:
        result = json.load(f)
    plan = [(d, f * result["saturating_rate"][d]) for d in datasets for f in fractions]
    probe_plan = [(d, float("inf")) for d in datasets]
    baseline = result.get("baseline_args")
    if baseline is not None:
        args.baseline_args = baseline
    for _ in range(args.rounds):
        n = len(result["rounds"]) + 1
        order = ("vllm", "kvhive") if n % 2 else ("kvhive", "vllm")     # as the recorded rounds alternate
        new = {name: run_server(name, args, probe_plan + plan, f"r{n}") for name in order}
        if baseline is not None:
            new[BASELINE] = run_server(BASELINE, args, plan, f"r{n}")
        new["load"] = loads(plan, new["kvhive"], new["vllm"])
        print(f"round {n}: load", " ".join(f"{k}={v}" for k, v in new["load"].items()), flush=True)
        result["rounds"].append(new)
    result["ratio_kvhive_over_vllm"] = ratios(result["rounds"])
    if baseline is not None:
        result["ratio_kvhive_over_baseline"] = ratios(result["rounds"], BASELINE, BASELINE_METRICS)
    result.setdefault("extended_by", []).append({"command": command(__file__), "date": time.strftime("%Y-%m-%d"),
                                                 "machine": machine()})
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "ttft_tail.json"))
    ap.add_argument("--work-dir", default=os.path.join(HERE, "out", "ttft_tail"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rates", default="0.5,0.7,0.9", help="fractions of the saturating rate")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--datasets", default=",".join(DATASETS))
    ap.add_argument("--kvhive-args", default="", help="extra arguments for kvhive serve")
    ap.add_argument("--baseline-args", default=None,
                    help="also run kvhive with these arguments each round (e.g. '--long-prefill-token-threshold 0', "
                         "the scheduler before long prefills were chunked); its medians are compared with kvhive's")
    ap.add_argument("--port", type=int, default=8131)
    ap.add_argument("--smoke", action="store_true", help="6 prompts, one rate, one round, random only")
    ap.add_argument("--extend", default=None, metavar="RESULT",
                    help="add --rounds rounds of --datasets to a recorded result at its saturating rates, "
                         "recompute its ratios and write it to --out")
    args = ap.parse_args()
    if args.smoke:
        args.rounds, args.rates, args.num_prompts, args.datasets = 1, "0.5", 6, "random"
    os.makedirs(args.work_dir, exist_ok=True)
    datasets = args.datasets.split(",")
    fractions = [float(f) for f in args.rates.split(",")]
    if args.extend is not None:
        return write(args.out, extend(args, datasets, fractions))
    first, second = "kvhive", "vllm"
    # Round 1 starts each server as few times as it can: the first is probed; the second is probed
    # and runs at once (the rates are known then); the first runs again. Later rounds alternate.
    probe_plan = [(d, float("inf")) for d in datasets]
    probes = {first: run_server(first, args, probe_plan, "probe")}
    second_runs = run_server(second, args, probe_plan, "r1", then=lambda runs: rates_plan(
        datasets, fractions, probes[first], runs))
    probes[second] = {k: v for k, v in second_runs.items() if k.endswith("@sat")}
    saturating = saturating_rates(datasets, probes[first], probes[second])
    plan = rates_plan(datasets, fractions, probes[first], probes[second])
    rounds = [{second: {k: v for k, v in second_runs.items() if not k.endswith("@sat")},
               first: run_server(first, args, plan, "r1")}]
    for i in range(args.rounds):
        if i:
            order = (first, second) if i % 2 else (second, first)   # round 1 ran the second first
            rounds.append({name: run_server(name, args, plan, f"r{i + 1}") for name in order})
        if args.baseline_args is not None:                          # last in every round
            rounds[i][BASELINE] = run_server(BASELINE, args, plan, f"r{i + 1}")
    result = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "command": command(__file__),
              "peer": "vLLM for CPU 0.32.0, float32", "shared": os.path.abspath(SHARED),
              "saturating_rate": saturating, "probes": probes, "rounds": rounds, "ratio_kvhive_over_vllm": ratios(rounds)}
    if args.baseline_args is not None:
        result["baseline_args"] = args.baseline_args
        result["ratio_kvhive_over_baseline"] = ratios(rounds, BASELINE, BASELINE_METRICS)
    return write(args.out, result)


def write(path: str, result: dict) -> int:
    """Save ``result`` at ``path`` and print its ratios."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    for key, per_metric in result["ratio_kvhive_over_vllm"].items():
        print(key, " ".join(f"{m}={v}" for m, v in per_metric.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
