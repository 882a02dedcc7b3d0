#!/usr/bin/env python3
"""The first turn of a conversation after a server restart, against its warm turns.

    python bench/restart_turn.py                 # writes bench/results/restart_turn.json
    python bench/restart_turn.py --smoke         # a short system prompt, one restart, under bench/out

``kvhive serve --disk-cache-dir D`` holds a conversation (``conversation_id``, a ~1,400-word system
prompt, then short user turns, greedy, 8 tokens each, streamed): the first turn computes the
prompt, the next --warm-turns are warm (the conversation's KV on the device). Then the server is
stopped (SIGTERM) and started again on the same directory, --restarts times; after each start the
conversation's next turns run the same way: the first one loads the KV from disk. TTFT is the
client's time to the first content token. The figure compared is the first turn after a restart
over the median warm turn (target: within 2x).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
from multiturn_vs_vllm import wait_up
from run_info import command, machine

HERE = os.path.dirname(os.path.abspath(__file__))
WORDS = ("alpha beta gamma delta epsilon zeta theta kappa lambda omicron sigma river mountain valley "
         "forest harbour lantern meadow orchard quarry").split()


def text(seed: int, words: int) -> str:
    """``words`` words drawn with ``seed`` (the same text on every run)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def start(port: int, disk: str, log_path: str) -> tuple[subprocess.Popen, float]:
    """``kvhive serve`` over the disk tier ``disk``; the process and its start-up seconds."""
    with open(log_path, "a") as log:             # the server keeps its own copy of the descriptor
        proc = subprocess.Popen([sys.executable, "-m", "kvhive.cli", "serve", "--port", str(port),
                                 "--disk-cache-dir", disk, "--dtype", "float32"],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, wait_up(port, proc)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, as an operator's restart does; wait for the exit."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=120)


def turn(port: int, conversation: str, messages: list[dict]) -> tuple[float, int, int]:
    """One streamed chat turn: TTFT seconds, prompt tokens, cached prompt tokens."""
    body = {"model": "smollm2-135m", "conversation_id": conversation, "messages": messages, "max_tokens": 8,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, usage = None, {}
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - t0
            usage = chunk.get("usage") or usage
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return (ttft if ttft is not None else time.perf_counter() - t0), usage.get("prompt_tokens", 0), cached


def conversation_turns(port: int, messages: list[dict], n: int, seed: int) -> list[dict]:
    """``n`` more turns of the conversation: each a short user message, then the assistant's."""
    rows = []
    for i in range(n):
        messages.append({"role": "user", "content": text(seed + i, 8)})
        ttft, prompt, cached = turn(port, "restart-bench", messages)
        rows.append({"ttft_s": round(ttft, 4), "prompt_tokens": prompt, "cached_tokens": cached})
        messages.append({"role": "assistant", "content": "noted"})
    return rows


def summarise(warm: list[dict], restarts: list[list[dict]]) -> dict:
    """Median warm TTFT, each restart's first-turn TTFT, and their ratios."""
    warm_s = statistics.median(r["ttft_s"] for r in warm)
    firsts = [turns[0]["ttft_s"] for turns in restarts]
    return {"warm_ttft_s": round(warm_s, 4), "first_after_restart_s": firsts,
            "ratio_first_over_warm": [round(f / warm_s, 2) for f in firsts],
            "median_ratio": round(statistics.median(f / warm_s for f in firsts), 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "restart_turn.json"))
    ap.add_argument("--restarts", type=int, default=5)
    ap.add_argument("--warm-turns", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=1400)
    ap.add_argument("--port", type=int, default=8133)
    ap.add_argument("--smoke", action="store_true", help="one restart, a short system prompt, under bench/out")
    args = ap.parse_args()
    if args.smoke:
        args.restarts, args.warm_turns, args.system_words = 1, 2, 200
        args.out = os.path.join(HERE, "out", "restart_turn.json")
    disk = tempfile.mkdtemp(prefix="kvhive-restart-")
    log = os.path.join(tempfile.gettempdir(), "kvhive-restart-bench.log")
    messages = [{"role": "system", "content": text(1, args.system_words)}]
    try:
        proc, up = start(args.port, disk, log)
        cold = conversation_turns(args.port, messages, 1, 100)
        warm = conversation_turns(args.port, messages, args.warm_turns, 200)
        restarts, starts = [], [round(up, 1)]
        for k in range(args.restarts):
            stop(proc)
            proc, up = start(args.port, disk, log)
            starts.append(round(up, 1))
            restarts.append(conversation_turns(args.port, messages, 2, 300 + 10 * k))
        stop(proc)
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    result = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "command": command(__file__),
              "cold": cold, "warm": warm, "restarts": restarts, "start_s": starts, **summarise(warm, restarts)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("warm_ttft_s", "first_after_restart_s", "median_ratio")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
