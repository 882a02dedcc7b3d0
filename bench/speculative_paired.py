#!/usr/bin/env python3
"""kvhive's speculative decode against its plain decode, paired request by request over HTTP.

    flock /tmp/kvhive-bench.lock python bench/speculative_paired.py      # writes bench/results/speculative_paired.json
    python bench/speculative_paired.py --smoke                           # agent turn, c1, 2 pairs, 16 tokens

``bench/speculative_workloads.py`` runs each config as its own server, minutes apart, and on this
two-core host plain decode at one request moves by up to a third between such runs. Here the two
servers (``kvhive_plain`` and ``kvhive_history`` of that script, the same flags) run at the same
time on two ports, and each measured request goes to one and right after to the other, the order
alternating pair by pair; only one server decodes at a time. A pair's ratio is speculative over
plain decode speed of two readings taken seconds apart, so slow drift of the host cancels out.

Per workload and concurrency: c1 takes ``--pairs`` variants one at a time; c8 takes ``--pairs``
batches of eight variants sent at once (aggregate decode speed of the batch). Every variant is
prefilled on both servers first (``max_tokens`` 1), so a pair compares decoding. The figure is the
median pair ratio; the geometric mean of the pairs is beside it. Variants come from
``bench/quoting_prompts.py`` and are new to both servers in every pair (each workload and
concurrency is its own tenant, as in ``speculative_workloads.py``), so the history server drafts
only from what earlier pairs of the same run taught it, as a server does in use. Outputs are
compared pair by pair (greedy: they must be equal).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import quoting_prompts
from multiturn_vs_vllm import served
from run_info import command, machine, save_record
from speculative_workloads import (
    COUNTERS,
    SPEC,
    aggregate_rate,
    body,
    decode_rate,
    fmt,
    spec_counters,
    start_command,
    stream_decode,
    target,
)

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = ("kvhive_plain", "kvhive_history")
BATCH = 8


def measure(port: int, workload: str, conc: int, variants: list[int], max_tokens: int) -> dict:
    """Decode ``variants`` on one server (one request, or all at once): speed, digests, drafts."""
    before = spec_counters(port, "kvhive")
    bodies = [body(workload, v, conc, max_tokens) for v in variants]
    if len(bodies) == 1:
        requests = [stream_decode(port, bodies[0])]
    else:
        with ThreadPoolExecutor(len(bodies)) as pool:
            requests = list(pool.map(lambda b: stream_decode(port, b), bodies))
    after = spec_counters(port, "kvhive")
    rate = decode_rate(requests[0]) if len(requests) == 1 else aggregate_rate(requests)
    return {"tok_s": round(rate or 0.0, 2),
            "digests": [hashlib.sha1(r["text"].encode()).hexdigest()[:12] for r in requests],
            "spec": {k: after[k] - before[k] for k in COUNTERS}}


def run_pairs(ports: dict[str, int], workload: str, conc: int, args: argparse.Namespace) -> dict:
    """Every pair of one workload and concurrency, both servers, the order alternating."""
    size = 1 if conc == 1 else BATCH
    pairs = []
    for i in range(args.pairs):
        variants = list(range(args.first_variant + i * size, args.first_variant + (i + 1) * size))
        for config in CONFIGS:
            for v in variants:
                stream_decode(ports[config], body(workload, v, conc, 1))
        order = CONFIGS if i % 2 == 0 else CONFIGS[::-1]
        readings = {c: measure(ports[c], workload, conc, variants, args.max_tokens) for c in order}
        plain, spec = readings["kvhive_plain"], readings["kvhive_history"]
        pair = {"variants": [variants[0], variants[-1]], "requests": len(variants), "first": order[0], "plain_tok_s": plain["tok_s"],
                "spec_tok_s": spec["tok_s"], "ratio": round(spec["tok_s"] / plain["tok_s"], 3) if plain["tok_s"] else None,
                "differ": sum(a != b for a, b in zip(plain["digests"], spec["digests"], strict=True)),
                "spec": spec["spec"]}
        pairs.append(pair)
        print(f"{workload}@c{conc} pair {i + 1}: plain {pair['plain_tok_s']} spec {pair['spec_tok_s']} "
              f"-> {pair['ratio']}x ({pair['first']} first)", flush=True)
    return summarise(pairs)


def summarise(pairs: list[dict]) -> dict:
    """The pairs and their figures: median and geometric mean ratio, each side's median speed."""
    ratios = [p["ratio"] for p in pairs if p["ratio"]]
    drafts = {k: sum(p["spec"][k] for p in pairs) for k in COUNTERS}
    return {"pairs": pairs, "median_ratio": round(statistics.median(ratios), 3) if ratios else None,
            "geomean_ratio": round(math.exp(statistics.fmean(math.log(r) for r in ratios)), 3) if ratios else None,
            "plain_median": round(statistics.median(p["plain_tok_s"] for p in pairs), 2),
            "spec_median": round(statistics.median(p["spec_tok_s"] for p in pairs), 2),
            "differ": sum(p["differ"] for p in pairs), "compared": sum(p["requests"] for p in pairs),
            "spec_totals": drafts}


def render(name: str, record: dict) -> list[str]:
    """Markdown for docs/benchmarks.md: the setup and one row per workload and concurrency."""
    rows = ["| workload | conc | pairs | plain tok/s | spec tok/s | spec / plain per pair | median | geo. mean "
            "| goal | met | tokens per drafted step | outputs differing |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for run, r in record["runs"].items():
        workload, conc = run.split("@")
        per_pair = ", ".join(f"{p['ratio']:.2f}" for p in r["pairs"] if p["ratio"])
        drafts = r["spec_totals"]
        per_step = f"{1 + drafts['num_accepted_tokens'] / drafts['num_drafts']:.2f}" if drafts["num_drafts"] else "-"
        goal = target(run)
        met = "-" if r["median_ratio"] is None else "yes" if r["median_ratio"] >= goal else "no"
        rows.append(f"| {workload} | {conc} | {len(r['pairs'])} | {fmt(r['plain_median'])} | {fmt(r['spec_median'])} | "
                    f"{per_pair} | {fmt(r['median_ratio'], 2, 'x')} | {fmt(r['geomean_ratio'], 2, 'x')} | >= {goal}x | "
                    f"{met} | {per_step} | {r['differ']} of {r['compared']} |")
    configs = ", ".join(f"`{c}` " + (json.dumps(SPEC[c]) if SPEC[c] else "no speculation") for c in CONFIGS)
    return [f"Configs, served at the same time: {configs}; {record['max_tokens']} tokens per request (greedy, "
            "ignore_eos); c1 pairs one request each, c8 pairs a batch of eight at once (aggregate). Each pair "
            "runs on one server and right after on the other, the first server alternating.", "", *rows, ""]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="default bench/results/speculative_paired.json (smoke: bench/out/)")
    ap.add_argument("--work-dir", default=os.path.join(HERE, "out", "speculative_paired"))
    ap.add_argument("--workloads", default=",".join(quoting_prompts.WORKLOADS))
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--pairs", type=int, default=8, help="pairs per workload and concurrency")
    ap.add_argument("--first-variant", type=int, default=0, help="the variant the first pair starts at")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--kvhive-args", default="", help="extra arguments for both kvhive servers")
    ap.add_argument("--port", type=int, default=8147, help="the plain server's; the speculative one takes the next")
    ap.add_argument("--smoke", action="store_true", help="agent turn, c1, 2 pairs, 16 tokens")
    args = ap.parse_args()
    if args.pairs < 1:
        ap.error("--pairs must be at least 1")
    if args.smoke:
        args.workloads, args.concurrency, args.pairs, args.max_tokens = "agent_summary", "1", 2, 16
    out = args.out or os.path.join(HERE, *(("out", "speculative_paired_smoke.json") if args.smoke
                                          else ("results", "speculative_paired.json")))
    workloads, concurrency = args.workloads.split(","), [int(c) for c in args.concurrency.split(",")]
    unknown = sorted(set(workloads) - set(quoting_prompts.WORKLOADS))
    if unknown:
        ap.error(f"unknown workload(s) {', '.join(unknown)} (known: {', '.join(quoting_prompts.WORKLOADS)})")
    os.makedirs(args.work_dir, exist_ok=True)
    ports = {c: args.port + i for i, c in enumerate(CONFIGS)}
    runs = {}
    with contextlib.ExitStack() as servers:
        for config in CONFIGS:
            cmd, env = start_command(config, ports[config], args.kvhive_args)
            servers.enter_context(served(cmd, ports[config], os.path.join(args.work_dir, f"{config}.log"), env))
            stream_decode(ports[config], body("open_chat", 11, 0, 8))    # warm-up, not measured
        for workload in workloads:
            for conc in concurrency:
                runs[f"{workload}@c{conc}"] = run_pairs(ports, workload, conc, args)
    record = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "command": command(__file__),
              "max_tokens": args.max_tokens, "spec": {c: SPEC[c] for c in CONFIGS}, "runs": runs}
    save_record(out, record, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
