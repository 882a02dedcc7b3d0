#!/usr/bin/env python3
"""TTFT per turn of multi-turn chats: sessions vs prefix caching only vs no caching (kvhive).

    python bench/sessions_ttft.py        # writes bench/results/sessions_ttft.json,
                                         # docs/benchmarks_sessions.md, docs/sessions_ttft.png

Two workloads on the default model (float32, CPU), in process (``LLMEngine``, no HTTP):

- seed 003: one conversation of 10 turns, ~500 new user tokens per turn plus a 16-token reply
  (greedy), the history re-sent each turn, as a chat client does;
- ../shared/bench/multiturn.py: its shared ~1500-token system prompt, user turns and canned
  replies (the fixed history), 2 conversations x 4 turns, sequential.

Each mode runs on a fresh engine: ``sessions`` (``session_id`` per conversation: held blocks
resumed, no re-hash or lookup), ``prefix`` (automatic prefix caching), ``none`` (caching off).
TTFT: wall time from add_request to the first token out of ``LLMEngine.step``. Scheduler overhead:
time in ``Scheduler.schedule`` on the admission step (hashing + lookup + allocation), per turn.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import random
import time

import torch

from kvhive.config import CacheConfig, EngineConfig, SchedulerConfig
from kvhive.engine import LLMEngine
from kvhive.model.loader import load_model
from kvhive.model_files import default_model_path
from kvhive.request import SamplingParams
from kvhive.tokenizer import Tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPLY = SamplingParams(max_tokens=16, temperature=0.0)
MODES = ("sessions", "prefix", "none")


def load_multiturn():
    path = os.path.join(REPO, "..", "shared", "bench", "multiturn.py")
    spec = importlib.util.spec_from_file_location("multiturn", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_engine(loaded, tok, mode: str) -> LLMEngine:
    cfg = EngineConfig(model_path=default_model_path(),
                       cache=CacheConfig(num_blocks=1024, enable_prefix_caching=mode != "none"),
                       scheduler=SchedulerConfig(max_model_len=8192, max_num_batched_tokens=8192))
    return LLMEngine(cfg, loaded=loaded, tokenizer=tok)


def run_turn(engine: LLMEngine, rid: str, ids: list[int], session_id: str | None):
    """One request to the end: (ttft_s, admission schedule() seconds, reply ids, cached tokens)."""
    sched = engine.scheduler
    real = sched.schedule
    times: list[float] = []

    def timed():
        t = time.perf_counter()
        plan = real()
        times.append(time.perf_counter() - t)
        return plan

    sched.schedule = timed
    start = time.perf_counter()
    engine.add_request(rid, ids, REPLY, session_id=session_id)
    ttft, tokens, cached = None, [], 0
    try:
        while engine.has_unfinished():
            for out in engine.step():
                if ttft is None and out.new_token_ids:
                    ttft = time.perf_counter() - start
                tokens += out.new_token_ids
                if out.finished:
                    cached = out.num_cached_tokens
    finally:
        sched.schedule = real
    return ttft, times[0], tokens, cached


def seed003(engine, tok, mode, rng_seed=3):
    mt = load_multiturn()
    rng = random.Random(rng_seed)
    messages, rows = [], []
    for t in range(10):
        text = " ".join(mt._sentence(rng) for _ in range(24))
        messages.append({"role": "user", "content": f"Part {t + 1} of my notes. {text}"})
        ids = tok.encode_chat(messages)
        ttft, sched_s, reply, cached = run_turn(engine, f"c-{t}", ids, "c" if mode == "sessions" else None)
        messages.append({"role": "assistant",
                         "content": tok.decode([x for x in reply if x not in tok.eos_token_ids])})
        rows.append({"turn": t + 1, "prompt_tokens": len(ids), "cached_tokens": cached,
                     "ttft_s": ttft, "schedule_s": sched_s})
    return rows


def multiturn(engine, tok, mode, num_convs=2, num_turns=4):
    mt = load_multiturn()
    system = "12345678 " + mt.system_prompt()
    rows = []
    for conv in range(num_convs):
        messages = [{"role": "system", "content": system}]
        for turn in range(num_turns):
            messages.append({"role": "user", "content": mt.user_turn(conv, turn)})
            ids = tok.encode_chat(messages)
            ttft, sched_s, _, cached = run_turn(engine, f"m{conv}-{turn}", ids,
                                                f"m{conv}" if mode == "sessions" else None)
            messages.append({"role": "assistant", "content": mt.canned_reply(conv, turn)})
            rows.append({"conv": conv, "turn": turn + 1, "prompt_tokens": len(ids), "cached_tokens": cached,
                         "ttft_s": ttft, "schedule_s": sched_s})
    return rows


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for mode in MODES:
        rows = results["seed003"][mode]
        axes[0].plot([r["turn"] for r in rows], [r["ttft_s"] * 1000 for r in rows], marker="o", label=mode)
        axes[1].plot([r["turn"] for r in rows], [r["schedule_s"] * 1e6 for r in rows], marker="o", label=mode)
    axes[0].set(title="seed 003: TTFT per turn (10 turns, ~500 new tokens each)", xlabel="turn", ylabel="TTFT (ms)")
    axes[1].set(title="admission schedule() time per turn", xlabel="turn", ylabel="µs", yscale="log")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_doc(results, path):
    s3 = results["seed003"]
    lines = ["# Sessions: TTFT per turn (kvhive)", "",
             "`python bench/sessions_ttft.py` (default model SmolLM2-135M-Instruct, float32, CPU, "
             f"{results['machine']}). In process (`LLMEngine`), greedy 16-token replies; each mode on a "
             "fresh engine. TTFT = add_request to first token; schedule = the admission step's "
             "`Scheduler.schedule()` (hashing + prefix lookup + allocation). vLLM comparisons: the lead's "
             "`bench/multiturn_vs_vllm.py`.", "",
             "![TTFT per turn](sessions_ttft.png)", "",
             "## Seed 003: one conversation, 10 turns, ~500 new tokens per turn", "",
             "| turn | prompt tok | TTFT sessions (ms) | TTFT prefix (ms) | TTFT none (ms) | sessions/none "
             "| cached sessions | cached prefix | schedule sessions (µs) | schedule prefix (µs) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for a, b, c in zip(s3["sessions"], s3["prefix"], s3["none"], strict=True):
        lines.append(f"| {a['turn']} | {a['prompt_tokens']} | {a['ttft_s'] * 1e3:.0f} | {b['ttft_s'] * 1e3:.0f} | "
                     f"{c['ttft_s'] * 1e3:.0f} | {a['ttft_s'] / c['ttft_s']:.2f} | {a['cached_tokens']} | "
                     f"{b['cached_tokens']} | {a['schedule_s'] * 1e6:.0f} | {b['schedule_s'] * 1e6:.0f} |")
    mt = results["multiturn"]
    lines += ["", "## ../shared/bench/multiturn.py workload (fixed history, 2 conversations x 4 turns)", "",
              "| conv | turn | prompt tok | TTFT sessions (ms) | TTFT prefix (ms) | TTFT none (ms) | cached sessions "
              "| cached prefix |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for a, b, c in zip(mt["sessions"], mt["prefix"], mt["none"], strict=True):
        lines.append(f"| {a['conv']} | {a['turn']} | {a['prompt_tokens']} | {a['ttft_s'] * 1e3:.0f} | "
                     f"{b['ttft_s'] * 1e3:.0f} | {c['ttft_s'] * 1e3:.0f} | {a['cached_tokens']} | "
                     f"{b['cached_tokens']} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    path = default_model_path()
    loaded, tok = load_model(path, dtype="float32", device="cpu"), Tokenizer.from_model_path(path)
    results = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "seed003": {}, "multiturn": {}}
    make_engine(loaded, tok, "none")     # warm-up of kernels
    for mode in MODES:
        results["seed003"][mode] = seed003(make_engine(loaded, tok, mode), tok, mode)
        results["multiturn"][mode] = multiturn(make_engine(loaded, tok, mode), tok, mode)
        print(mode, [round(r["ttft_s"] * 1000) for r in results["seed003"][mode]], flush=True)
    with open(os.path.join(REPO, "bench", "results", "sessions_ttft.json"), "w") as f:
        json.dump(results, f, indent=1)
    plot(results, os.path.join(REPO, "docs", "sessions_ttft.png"))
    write_doc(results, os.path.join(REPO, "docs", "benchmarks_sessions.md"))


if __name__ == "__main__":
    main()
