#!/usr/bin/env python3
"""Retention priorities under memory pressure: hit rate and TTFT of high-priority shared prefixes.

A ``kvhive serve`` with a device pool smaller than the working set (``--num-blocks``, no CPU or
disk tier) gets a stream of requests, one at a time: many one-off prompts (each its own text, never
asked again) and, between them, questions on a few shared documents (the prefixes). Two arms on the
same build, each on a server of its own, started together for each round:

- ``priority``: every request on a shared document sends ``kv_cache_retention_config``
  ``{"token_range_retention_configs": [{"token_start": 0, "token_end": <document tokens>,
  "priority": 90}]}``, so the pool evicts the one-offs' blocks (default priority 35) before the
  documents';
- ``lru``: the same requests without the field, so the pool evicts in least-recently-used order.

Prompts go to ``/v1/completions`` as token ids (tokenized once through the server's ``/tokenize``),
so a document is exactly ``--prefix-tokens`` tokens, a whole number of blocks, and a question's
``cached_tokens`` (``usage.prompt_tokens_details``, streamed with ``stream_options.include_usage``)
reads as a fraction of it: the hit rate is the sum of the cached tokens (up to the document's length)
over the sum of the documents' tokens, on every question but each document's first. TTFT is the
time from sending a request to its first streamed token. Each request goes to both servers in
turn, the one that goes first alternating, so that the host's load falls on both arms alike; the
"busy" column sums an arm's request latencies.

The defaults: 4 documents of 1,024 tokens (256 blocks of 16) and 4 one-offs of 512 tokens between
questions (8 questions per document, in shuffled rounds), in a pool of 384 blocks (6,144 tokens).
Between two questions on one document the other requests fill ~700 blocks (median), almost twice
the pool, so least-recently-used eviction has dropped the document by the time it is asked again,
while the documents at priority 90 (256 blocks) leave room for the request being served.

    flock /tmp/kvhive-bench.lock python bench/retention_priority.py --rounds 2
    python bench/retention_priority.py --rounds 1 --prefixes 2 --uses 3 --oneoffs 2 --prefix-tokens 256 \\
        --oneoff-tokens 256 --num-blocks 64 --out /tmp/retention_priority.json    # a quick check (a minute)

The result goes to ``bench/results/retention_priority.json``; ``python bench/report.py`` renders it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.client
import json
import os
import random
import shlex
import statistics
import sys
import time

from multiturn_vs_vllm import served
from run_info import command, machine
from sessions_vs_vllm import chat_stream, load_multiturn

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = "smollm2-135m"
ARMS = ("priority", "lru")
TARGET_PRIORITY, TARGET_LRU = 0.95, 0.5


def post(port: int, path: str, body: dict) -> dict:
    """POST a JSON body, return the JSON answer (RuntimeError on a non-200)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    if resp.status != 200:
        raise RuntimeError(f"{path}: HTTP {resp.status}: {data[:500]!r}")
    return json.loads(data)


def tokens(port: int, text: str) -> list[int]:
    """The server's token ids of ``text``, without special tokens."""
    return post(port, "/tokenize", {"model": MODEL, "prompt": text, "add_special_tokens": False})["tokens"]


def completion_stream(port: int, body: dict) -> dict:
    """POST one streamed completion: TTFT (to the first chunk with text), prompt and cached tokens."""
    start = time.perf_counter()
    reply = chat_stream(port, "/v1/completions", body, {})
    details = reply.usage.get("prompt_tokens_details") or {}
    return {"ttft_s": reply.ttft_s, "latency_s": time.perf_counter() - start,
            "prompt_tokens": reply.usage.get("prompt_tokens"), "cached_tokens": details.get("cached_tokens") or 0}


def sentences(rng: random.Random, count: int) -> str:
    """``count`` sentences of ../shared/bench/multiturn.py's generator (~22 tokens each)."""
    mt = _multiturn()
    return " ".join(mt._sentence(rng) for _ in range(count))


@functools.cache
def _multiturn():
    return load_multiturn()


def build_workload(port: int, args: argparse.Namespace) -> dict:
    """Token ids of the documents, the questions and the one-offs, and the order they are sent in.

    Each question round shuffles the documents; ``--oneoffs`` one-off prompts come before each
    question. Every text opens with its own number, so no two prompts share a first block but a
    document's questions."""
    rng = random.Random(args.seed)
    words = max(args.prefix_tokens, args.oneoff_tokens) // 12 + 8      # sentences of ~22 tokens: ample
    docs = [tokens(port, f"Document {i}. " + sentences(rng, words))[:args.prefix_tokens]
            for i in range(args.prefixes)]
    if any(len(d) < args.prefix_tokens for d in docs):
        raise RuntimeError("a document came out shorter than --prefix-tokens")
    schedule: list[dict] = []
    oneoff = 0
    for use in range(args.uses):
        for doc in rng.sample(range(args.prefixes), args.prefixes):
            for _ in range(args.oneoffs):
                ids = tokens(port, f"Request {oneoff}. " + sentences(rng, words))[:args.oneoff_tokens]
                schedule.append({"kind": "oneoff", "index": oneoff, "prompt": ids})
                oneoff += 1
            question = tokens(port, f"\n\nQuestion {use} on document {doc}: which component "
                                    f"{rng.choice(['retries', 'caches', 'batches', 'drops'])} requests first?")
            schedule.append({"kind": "prefix", "index": doc, "use": use, "prompt": docs[doc] + question})
    return {"schedule": schedule, "reuse_blocks": reuse_blocks(schedule, args)}


def reuse_blocks(schedule: list[dict], args: argparse.Namespace) -> list[int]:
    """For each repeat question: the blocks the requests sent since its document's last question
    filled (prompt and output, each request's own; the document's other questions' documents once)."""
    last: dict[int, int] = {}
    out = []
    blocks = lambda n: -(-n // args.block_size)  # noqa: E731
    for i, item in enumerate(schedule):
        if item["kind"] != "prefix":
            continue
        if item["index"] in last:
            between = schedule[last[item["index"]] + 1:i]
            docs = {b["index"] for b in between if b["kind"] == "prefix"}
            out.append(sum(blocks(len(b["prompt"]) + args.max_tokens) for b in between if b["kind"] == "oneoff")
                       + len(docs) * blocks(args.prefix_tokens))
        last[item["index"]] = i
    return out


def request_body(item: dict, arm: str, args: argparse.Namespace) -> dict:
    body = {"model": MODEL, "prompt": item["prompt"], "max_tokens": args.max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    if arm == "priority" and item["kind"] == "prefix":
        rng = {"token_start": 0, "token_end": args.prefix_tokens, "priority": args.priority}
        if args.duration_ms:
            rng["duration_ms"] = args.duration_ms
        body["kv_cache_retention_config"] = {"token_range_retention_configs": [rng]}
    return body


def run_arms(ports: dict[str, int], workload: dict, index: int, args: argparse.Namespace) -> dict[str, dict]:
    """The schedule against the arms' servers side by side, one request at a time: each request goes
    to every arm in turn (which goes first alternates), so that the host's load falls on both alike."""
    arms = list(ports)
    rows: dict[str, list[dict]] = {arm: [] for arm in arms}
    busy = dict.fromkeys(arms, 0.0)
    load_start = os.getloadavg()[0]
    for i, item in enumerate(workload["schedule"]):
        for arm in arms if (i + index) % 2 == 0 else arms[::-1]:
            r = completion_stream(ports[arm], request_body(item, arm, args))
            busy[arm] += r["latency_s"]
            rows[arm].append({"kind": item["kind"], "index": item["index"],
                              **({"use": item["use"]} if "use" in item else {}),
                              **{k: r[k] for k in ("ttft_s", "latency_s", "prompt_tokens", "cached_tokens")}})
    load = [load_start, os.getloadavg()[0]]
    return {arm: {"wall_s": busy[arm], "load_average_1m": load, "rows": rows[arm]} for arm in arms}


def summarize(run: dict, prefix_tokens: int) -> dict:
    """Hit rate and TTFT of the repeat questions (each document's first is cold in both arms), and
    the one-offs' TTFT."""
    repeats = [r for r in run["rows"] if r["kind"] == "prefix" and r["use"] > 0]
    firsts = [r for r in run["rows"] if r["kind"] == "prefix" and r["use"] == 0]
    oneoffs = [r for r in run["rows"] if r["kind"] == "oneoff"]
    hit = sum(min(r["cached_tokens"], prefix_tokens) for r in repeats) / (prefix_tokens * len(repeats))
    ttft = sorted(r["ttft_s"] for r in repeats if r["ttft_s"] is not None)
    return {"hit_rate": hit, "full_hits": sum(r["cached_tokens"] >= prefix_tokens for r in repeats),
            "repeats": len(repeats), "ttft_p50_s": statistics.median(ttft), "ttft_p90_s": ttft[int(0.9 * len(ttft))],
            "ttft_first_p50_s": statistics.median(r["ttft_s"] for r in firsts if r["ttft_s"] is not None),
            "oneoff_ttft_p50_s": statistics.median(r["ttft_s"] for r in oneoffs if r["ttft_s"] is not None),
            "oneoff_cached_tokens": sum(r["cached_tokens"] for r in oneoffs),
            "wall_s": run["wall_s"], "load_average_1m": run["load_average_1m"]}


def serve_round(index: int, args: argparse.Namespace, workload: dict | None) -> tuple[dict, dict]:
    """Start a server per arm, build the workload on the first (its tokenizer), run the schedule on
    all of them, stop them."""
    ports = {arm: args.port + k for k, arm in enumerate(args.arms)}
    with contextlib.ExitStack() as stack:
        for arm, port in ports.items():
            cmd = [sys.executable, "-m", "kvhive.cli", "serve", "--port", str(port), "--log-level", "warning",
                   "--dtype", args.dtype, "--num-blocks", str(args.num_blocks), "--block-size", str(args.block_size),
                   "--cpu-offload-gb", "0", *shlex.split(args.kvhive_args)]
            stack.enter_context(served(cmd, port, os.path.join(args.log_dir, f"retention_priority_{arm}_r{index + 1}.log")))
        workload = workload or build_workload(next(iter(ports.values())), args)
        for port in ports.values():
            warm = {"kind": "oneoff", "prompt": tokens(port, "Warm up. " * 40)}
            completion_stream(port, request_body(warm, "lru", args))
        runs = run_arms(ports, workload, index, args)
    for arm, run in runs.items():
        s = summarize(run, args.prefix_tokens)
        print(f"{arm}: hit rate {s['hit_rate']:.3f} ({s['full_hits']}/{s['repeats']} full), repeat TTFT p50 "
              f"{s['ttft_p50_s'] * 1000:,.0f} ms, one-offs {s['oneoff_ttft_p50_s'] * 1000:,.0f} ms, "
              f"busy {s['wall_s']:.0f} s", flush=True)
    return runs, workload


def table(record: dict) -> list[str]:
    """Markdown: per round and arm, the repeat questions' hit rate and TTFT; then the targets."""
    prefix = record["setup"]["prefix_tokens"]
    lines = ["| round | arm | hit rate (repeat questions) | full hits | TTFT p50 (ms) | TTFT p90 (ms) | "
             "first question TTFT p50 (ms) | one-offs TTFT p50 (ms) | busy (s) | load average |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for i, rnd in enumerate(record["rounds"], 1):
        for arm in (a for a in ARMS if a in rnd):
            s = summarize(rnd[arm], prefix)
            lines.append(f"| {i} | {arm} | {s['hit_rate']:.3f} | {s['full_hits']}/{s['repeats']} | "
                         f"{s['ttft_p50_s'] * 1000:,.0f} | {s['ttft_p90_s'] * 1000:,.0f} | "
                         f"{s['ttft_first_p50_s'] * 1000:,.0f} | {s['oneoff_ttft_p50_s'] * 1000:,.0f} | "
                         f"{s['wall_s']:.0f} | {s['load_average_1m'][0]:.1f} to {s['load_average_1m'][1]:.1f} |")
    return [*lines, "", *targets(record)]


def targets(record: dict) -> list[str]:
    """The hit-rate targets on the worst round of each arm, and the TTFT ratio of the medians."""
    prefix = record["setup"]["prefix_tokens"]
    arms = {arm: [summarize(r[arm], prefix) for r in record["rounds"] if arm in r] for arm in ARMS}
    if not all(arms.values()):
        return []
    pri, lru = min(s["hit_rate"] for s in arms["priority"]), max(s["hit_rate"] for s in arms["lru"])
    ratio = statistics.median(s["ttft_p50_s"] for s in arms["priority"]) / statistics.median(
        s["ttft_p50_s"] for s in arms["lru"])
    met = "met" if pri >= TARGET_PRIORITY and lru < TARGET_LRU else "not met"
    return [f"Hit rate of the repeat questions: with priorities ≥ {pri:.3f} in every round, plain LRU ≤ {lru:.3f} "
            f"(target ≥ {TARGET_PRIORITY} where LRU < {TARGET_LRU}: {met}); their median TTFT with priorities is "
            f"**{ratio:.2f}x** LRU's.", ""]


def setup_lines(record: dict) -> list[str]:
    """Markdown: the workload and the pool, and how far apart a document's questions are."""
    s = record["setup"]
    reuse = s["reuse_blocks"]
    return [f"{s['prefixes']} documents of {s['prefix_tokens']:,} tokens asked {s['uses']} times each (priority "
            f"{s['priority']}), {s['oneoffs']} one-offs of {s['oneoff_tokens']:,} tokens before each question, "
            f"{s['max_tokens']} output tokens, greedy, one request at a time; a pool of {s['num_blocks']} blocks of "
            f"{s['block_size']} ({s['num_blocks'] * s['block_size']:,} tokens), no CPU or disk tier, `--dtype "
            f"{s['dtype']}`. Between two questions on a document the other requests fill {min(reuse):,} to "
            f"{max(reuse):,} blocks (median {statistics.median(reuse):,.0f}).", ""]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--arms", default=",".join(ARMS), help="which of priority,lru to run")
    ap.add_argument("--prefixes", type=int, default=4, help="shared documents")
    ap.add_argument("--prefix-tokens", type=int, default=1024, help="tokens of each document")
    ap.add_argument("--uses", type=int, default=8, help="questions per document")
    ap.add_argument("--oneoffs", type=int, default=4, help="one-off prompts before each question")
    ap.add_argument("--oneoff-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--priority", type=int, default=90)
    ap.add_argument("--duration-ms", type=int, default=None, help="the documents' priority lasts this long")
    ap.add_argument("--num-blocks", type=int, default=384, help="the device pool, in blocks")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--kvhive-args", default="", help="extra kvhive serve flags")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--port", type=int, default=8173)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "retention_priority.json"))
    ap.add_argument("--log-dir", default=os.path.join(HERE, "out"), help="the servers' logs")
    ap.add_argument("--notes", default="", help="a note stored with the result")
    args = ap.parse_args()
    args.arms = [a for a in args.arms.split(",") if a]
    if unknown := set(args.arms) - set(ARMS):
        ap.error(f"unknown arms: {sorted(unknown)}")
    if args.prefix_tokens % args.block_size:
        ap.error("--prefix-tokens must be a multiple of --block-size (a document is whole blocks)")
    os.makedirs(args.log_dir, exist_ok=True)
    workload, rounds = None, []
    for i in range(args.rounds):
        rnd, workload = serve_round(i, args, workload)
        rounds.append(rnd)
    setup = {k: getattr(args, k) for k in ("prefixes", "prefix_tokens", "uses", "oneoffs", "oneoff_tokens",
                                           "max_tokens", "priority", "duration_ms", "num_blocks", "block_size",
                                           "dtype", "kvhive_args", "seed")}
    setup["reuse_blocks"] = workload["reuse_blocks"]
    result = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "command": command(__file__),
              "setup": setup, "rounds": rounds, **({"notes": args.notes} if args.notes else {})}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("\n".join(setup_lines(result) + table(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
