#!/usr/bin/env python3
"""TTFT per turn of multi-turn chats: sessions vs prefix caching only vs no caching (kvhive).

    python bench/sessions_ttft.py             # writes bench/results/sessions_ttft.json,
                                              # docs/benchmarks_sessions.md, docs/sessions_ttft.png
    python bench/sessions_ttft.py --turns 14  # seed 003 up to ~7,700 tokens (context 8,192)

Two workloads on the default model (float32, CPU), in process (``LLMEngine``, no HTTP):

- seed 003: one conversation of ``--turns`` (10) turns, ~500 new user tokens per turn plus a 16-token reply
  (greedy), the history re-sent each turn, as a chat client does;
- ../shared/bench/multiturn.py: its shared ~1500-token system prompt, user turns and canned
  replies (the fixed history), 2 conversations x 4 turns, sequential.

Each mode has its own engine: ``sessions`` (``session_id`` per conversation: held blocks
resumed, no re-hash or lookup), ``prefix`` (automatic prefix caching), ``none`` (caching off). The
three engines live side by side and the modes take turns, one conversation turn each, in an order
that rotates every turn: load from elsewhere on a shared machine then hits all modes alike instead
of one mode's whole run (an earlier sequential run showed sessions 2.4x slower than prefix on
three turns whose step plans were identical; interleaved, they came out at 0.83-1.10x).
TTFT: wall time from add_request to the first token out of ``LLMEngine.step``; beside it the
process CPU time of the same span and the tokens the model computed in it (a timing-free check
that a mode does the work it should). Scheduler overhead: time in ``Scheduler.schedule`` on the
admission step (hashing + lookup + allocation), per turn. Over HTTP and against vLLM:
``bench/sessions_vs_vllm.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
from sessions_vs_vllm import interleave, load_multiturn, seed003_user_turns

from kvhive.config import CacheConfig, EngineConfig, SchedulerConfig
from kvhive.core.model_files import default_model_path
from kvhive.core.tokenizer import Tokenizer
from kvhive.engine.core import LLMEngine
from kvhive.model.loader import load_model
from kvhive.request import SamplingParams

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPLY = SamplingParams(max_tokens=16, temperature=0.0)
MODES = ("sessions", "prefix", "none")


def make_engine(loaded, tok, mode: str) -> LLMEngine:
    cfg = EngineConfig(model_path=default_model_path(),
                       cache=CacheConfig(num_blocks=1024, enable_prefix_caching=mode != "none"),
                       scheduler=SchedulerConfig(max_model_len=8192, max_num_batched_tokens=8192))
    return LLMEngine(cfg, loaded=loaded, tokenizer=tok)


def run_turn(engine: LLMEngine, rid: str, ids: list[int], session_id: str | None) -> dict:
    """One request to the end: TTFT, CPU time and model tokens up to the first token, reply, cached tokens."""
    sched, runner = engine.scheduler, engine.runner
    real_schedule, real_execute = sched.schedule, runner.execute
    times: list[float] = []
    computed = [0]

    def timed():
        t = time.perf_counter()
        plan = real_schedule()
        times.append(time.perf_counter() - t)
        return plan

    def counted(plan):
        computed[0] += sum(s.num_new_tokens for s in plan.seqs)
        return real_execute(plan)

    sched.schedule, runner.execute = timed, counted
    start, cpu_start = time.perf_counter(), time.process_time()
    engine.add_request(rid, ids, REPLY, session_id=session_id)
    row = {"ttft_s": None}
    tokens, cached = [], 0
    try:
        while engine.has_unfinished():
            for out in engine.step():
                if row["ttft_s"] is None and out.new_token_ids:
                    row.update(ttft_s=time.perf_counter() - start, cpu_s=time.process_time() - cpu_start,
                               computed_tokens=computed[0])
                tokens += out.new_token_ids
                if out.finished:
                    cached = out.num_cached_tokens
    finally:
        # Drop the instance attributes: the class methods show through again.
        del sched.schedule, runner.execute
    row.update(schedule_s=times[0], prompt_tokens=len(ids), cached_tokens=cached, reply=tokens)
    return row


def seed003(engine, tok, mode, num_turns=10, sentences=24):
    """Seed 003's conversation, one turn per ``next()``: each turn's row."""
    messages = []
    for t, text in enumerate(seed003_user_turns(num_turns, sentences)):
        messages.append({"role": "user", "content": text})
        ids = tok.encode_chat(messages)
        row = run_turn(engine, f"c-{t}", ids, "c" if mode == "sessions" else None)
        reply = row.pop("reply")
        messages.append({"role": "assistant",
                         "content": tok.decode([x for x in reply if x not in tok.eos_token_ids])})
        yield {"turn": t + 1, **row}


def multiturn(engine, tok, mode, num_convs=2, num_turns=4):
    """../shared/bench/multiturn.py's fixed history, sequential, one turn per ``next()``."""
    mt = load_multiturn()
    system = "12345678 " + mt.system_prompt()
    for conv in range(num_convs):
        messages = [{"role": "system", "content": system}]
        for turn in range(num_turns):
            messages.append({"role": "user", "content": mt.user_turn(conv, turn)})
            ids = tok.encode_chat(messages)
            row = run_turn(engine, f"m{conv}-{turn}", ids, f"m{conv}" if mode == "sessions" else None)
            row.pop("reply")
            messages.append({"role": "assistant", "content": mt.canned_reply(conv, turn)})
            yield {"conv": conv, "turn": turn + 1, **row}


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
             f"{results['machine']}). In process (`LLMEngine`), greedy 16-token replies; one engine per "
             "mode, the modes interleaved turn by turn in a rotating order (so that load from elsewhere "
             "hits all modes alike). TTFT = add_request to first token; computed = tokens the model ran "
             "up to the first token; schedule = the admission step's `Scheduler.schedule()` (hashing + "
             "prefix lookup + allocation). Over real HTTP, with vLLM for CPU beside it: "
             "`bench/sessions_vs_vllm.py` (below).", "",
             "![TTFT per turn](sessions_ttft.png)", "",
             f"## Seed 003: one conversation, {len(s3['sessions'])} turns, ~500 new tokens per turn", "",
             "| turn | prompt tok | TTFT sessions (ms) | TTFT prefix (ms) | TTFT none (ms) | sessions/none "
             "| sessions/prefix | cached sessions | cached prefix | computed sessions | computed prefix "
             "| schedule sessions (µs) | schedule prefix (µs) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for a, b, c in zip(s3["sessions"], s3["prefix"], s3["none"], strict=True):
        lines.append(f"| {a['turn']} | {a['prompt_tokens']} | {a['ttft_s'] * 1e3:.0f} | {b['ttft_s'] * 1e3:.0f} | "
                     f"{c['ttft_s'] * 1e3:.0f} | {a['ttft_s'] / c['ttft_s']:.2f} | {a['ttft_s'] / b['ttft_s']:.2f} | "
                     f"{a['cached_tokens']} | {b['cached_tokens']} | {a['computed_tokens']} | "
                     f"{b['computed_tokens']} | {a['schedule_s'] * 1e6:.0f} | {b['schedule_s'] * 1e6:.0f} |")
    mt = results["multiturn"]
    lines += ["", "## ../shared/bench/multiturn.py workload (fixed history, 2 conversations x 4 turns)", "",
              "The canned replies differ from the engine's own, so each turn diverges from its session "
              "and takes the prefix path (same plans as `prefix`: tests/test_sessions_perf_logic.py).", "",
              "| conv | turn | prompt tok | TTFT sessions (ms) | TTFT prefix (ms) | TTFT none (ms) "
              "| sessions/prefix | cached sessions | cached prefix | computed sessions | computed prefix |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for a, b, c in zip(mt["sessions"], mt["prefix"], mt["none"], strict=True):
        lines.append(f"| {a['conv']} | {a['turn']} | {a['prompt_tokens']} | {a['ttft_s'] * 1e3:.0f} | "
                     f"{b['ttft_s'] * 1e3:.0f} | {c['ttft_s'] * 1e3:.0f} | {a['ttft_s'] / b['ttft_s']:.2f} | "
                     f"{a['cached_tokens']} | {b['cached_tokens']} | {a['computed_tokens']} | "
                     f"{b['computed_tokens']} |")
    lines += ["", HTTP_SECTION]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


# The HTTP benchmark's section of docs/benchmarks_sessions.md: a pointer, its tables are its own file.
HTTP_SECTION = """## Over HTTP, with vLLM for CPU (bench/sessions_vs_vllm.py)

The same two workloads through `kvhive serve` (sessions via `POST /v1/context` + `x-session-id`,
prefix caching only, `--no-enable-prefix-caching`) and vLLM for CPU's prefix caching, TTFT from
streamed responses: session 4 in [sessions_s4/benchmarks_sessions_http.md](sessions_s4/benchmarks_sessions_http.md)
(vLLM: [sessions_s4_vllm/benchmarks_sessions_http.md](sessions_s4_vllm/benchmarks_sessions_http.md)),
session 2 in [benchmarks_sessions_http.md](benchmarks_sessions_http.md)."""


def warm_up(loaded, tok) -> None:
    """Run one prefill and a few decodes so that no mode's first turn pays for kernel set-up."""
    engine = make_engine(loaded, tok, "none")
    ids = tok.encode_chat([{"role": "user", "content": "warm up " * 300}])
    run_turn(engine, "warm-up", ids, None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=10, help="seed 003: turns (14 reach ~7,700 of 8,192 tokens)")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    path = default_model_path()
    loaded, tok = load_model(path, dtype="float32", device="cpu"), Tokenizer.from_model_path(path)
    results = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "seed003": {}, "multiturn": {}}
    warm_up(loaded, tok)
    workloads = (("seed003", lambda engine, mode: seed003(engine, tok, mode, num_turns=args.turns)),
                 ("multiturn", lambda engine, mode: multiturn(engine, tok, mode)))
    for name, workload in workloads:
        engines = {mode: make_engine(loaded, tok, mode) for mode in MODES}
        results[name] = interleave({mode: workload(engines[mode], mode) for mode in MODES})
        del engines
        for mode in MODES:
            print(name, mode, [round(r["ttft_s"] * 1000) for r in results[name][mode]], flush=True)
    with open(os.path.join(REPO, "bench", "results", "sessions_ttft.json"), "w") as f:
        json.dump(results, f, indent=1)
    plot(results, os.path.join(REPO, "docs", "sessions_ttft.png"))
    write_doc(results, os.path.join(REPO, "docs", "benchmarks_sessions.md"))


if __name__ == "__main__":
    main()
