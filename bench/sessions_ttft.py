#!/usr/bin/env python3
"""TTFT per turn of multi-turn chats: sessions vs prefix caching only vs no caching (kvhive).

    python bench/sessions_ttft.py --turns 14  # writes bench/results/sessions_ttft.json and
                                              # docs/sessions_ttft.png; 14 turns reach ~7,700 of
                                              # the model's 8,192 tokens

Two workloads on the default model (float32, CPU), in process (``LLMEngine``, no HTTP):

- the long chat: one conversation of ``--turns`` (10) turns, ~500 new user tokens per turn plus a 16-token reply
  (greedy), the history re-sent each turn, as a chat client does;
- ../shared/bench/multiturn.py: its shared ~1500-token system prompt, user turns and canned
  replies (the fixed history), 2 conversations x 4 turns, sequential.

Each mode has its own engine: ``sessions`` (``session_id`` per conversation: held blocks
resumed, no re-hash or lookup), ``prefix`` (automatic prefix caching), ``none`` (caching off). The
three engines live side by side and the modes take turns, one conversation turn each, in an order
that rotates every turn: load from elsewhere on a shared machine then hits all modes alike instead
of one mode's whole run (run one mode after another, turns with identical step plans can differ
by 2x).
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
import time

import torch
from run_info import command, machine
from sessions_vs_vllm import interleave, load_multiturn, long_chat_user_turns

from kvhive.config import CacheConfig, EngineConfig, SchedulerConfig
from kvhive.core.model_files import default_model_path
from kvhive.core.tokenizer import Tokenizer
from kvhive.engine.llm_engine import LLMEngine
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


def long_chat(engine, tok, mode, num_turns=10, sentences=24):
    """The long chat, one turn per ``next()``: each turn's row."""
    messages = []
    for t, text in enumerate(long_chat_user_turns(num_turns, sentences)):
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
        rows = results["long_chat"][mode]
        axes[0].plot([r["turn"] for r in rows], [r["ttft_s"] * 1000 for r in rows], marker="o", label=mode)
        axes[1].plot([r["turn"] for r in rows], [r["schedule_s"] * 1e6 for r in rows], marker="o", label=mode)
    axes[0].set(title=f"long chat: TTFT per turn ({len(rows)} turns, ~500 new tokens each)", xlabel="turn", ylabel="TTFT (ms)")
    axes[1].set(title="admission schedule() time per turn", xlabel="turn", ylabel="µs", yscale="log")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def warm_up(loaded, tok) -> None:
    """Run one prefill and a few decodes so that no mode's first turn pays for kernel set-up."""
    engine = make_engine(loaded, tok, "none")
    ids = tok.encode_chat([{"role": "user", "content": "warm up " * 300}])
    run_turn(engine, "warm-up", ids, None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=10, help="long chat: turns (14 reach ~7,700 of 8,192 tokens)")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "sessions_ttft.json"))
    ap.add_argument("--plot", default=os.path.join(REPO, "docs", "sessions_ttft.png"))
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    path = default_model_path()
    loaded, tok = load_model(path, dtype="float32", device="cpu"), Tokenizer.from_model_path(path)
    results = {"machine": machine(), "command": command(__file__),
               "date": time.strftime("%Y-%m-%d"), "long_chat": {}, "multiturn": {}}
    warm_up(loaded, tok)
    workloads = (("long_chat", lambda engine, mode: long_chat(engine, tok, mode, num_turns=args.turns)),
                 ("multiturn", lambda engine, mode: multiturn(engine, tok, mode)))
    for name, workload in workloads:
        engines = {mode: make_engine(loaded, tok, mode) for mode in MODES}
        results[name] = interleave({mode: workload(engines[mode], mode) for mode in MODES})
        del engines
        for mode in MODES:
            print(name, mode, [round(r["ttft_s"] * 1000) for r in results[name][mode]], flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    plot(results, args.plot)


if __name__ == "__main__":
    main()
