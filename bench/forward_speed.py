#!/usr/bin/env python3
"""Forward-pass speed of the default model through ModelRunner: prefill and decode, float32 and bf16.

    python bench/forward_speed.py                       # prefill 1024/1600, decode batch 1/8 at 1600
    python bench/forward_speed.py --dtype bfloat16 --profile decode8
    python bench/forward_speed.py --matmuls             # projections by rows: GGUF blocks vs dense
    python bench/forward_speed.py --device cuda --dtype float32 --profile long   # on a GPU

Times are the min and median of --repeat runs after one warm-up, with
torch.set_num_threads(--threads). A timing run writes ``bench/results/forward_speed.json``
(``--out``); ``python bench/report.py`` turns it into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch
from run_info import command, machine

from kvhive.core.model_files import default_model_path
from kvhive.engine.runner import ModelRunner
from kvhive.engine.step import ScheduledSeq, StepPlan
from kvhive.model import quant_rows
from kvhive.model.loader import load_model
from kvhive.request import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
BLOCK = 16


def prefill_plan(n: int, first_block: int = 0) -> StepPlan:
    tokens = [random.randrange(10, 40000) for _ in range(n)]
    table = list(range(first_block, first_block + (n + BLOCK) // BLOCK + 1))
    return StepPlan([ScheduledSeq(f"p{first_block}", tokens, 0, table, True, GREEDY)])


def decode_plan(batch: int, context: int) -> StepPlan:
    per_seq = context // BLOCK + 2
    rng = random.Random(0)
    order = list(range(batch * per_seq))
    rng.shuffle(order)                                   # realistic, non-contiguous tables
    seqs = [ScheduledSeq(f"d{i}", [rng.randrange(10, 40000)], context,
                         order[i * per_seq:(i + 1) * per_seq], True, GREEDY) for i in range(batch)]
    return StepPlan(seqs)


def warm_prefill_plan(prefix: int, new: int) -> StepPlan:
    """``new`` tokens on a cached ``prefix`` (a shared system prompt), as a warm turn computes."""
    table = list(range((prefix + new) // BLOCK + 1))
    tokens = [random.randrange(10, 40000) for _ in range(new)]
    return StepPlan([ScheduledSeq("warm", tokens, prefix, table, True, GREEDY)])


def sync(runner: ModelRunner) -> None:
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


def timed(runner: ModelRunner, plan: StepPlan, repeat: int) -> dict[str, float]:
    """Min and median ms over repeat runs after one warm-up (the machine may be shared: min is the signal)."""
    runner.execute(plan)
    times = []
    for _ in range(repeat):
        sync(runner)
        t = time.perf_counter()
        runner.execute(plan)
        sync(runner)
        times.append((time.perf_counter() - t) * 1000)
    return {"min_ms": min(times), "median_ms": statistics.median(times)}


def time_matmuls(repeat: int, dtypes: list[str]) -> None:
    """The 120 fused projections of all layers (o and down adding the residual, as the model does),
    by rows: the GGUF-block kernel vs the dense oneDNN copy, float32 and/or bfloat16 activations."""
    for dtype in dtypes:
        model = load_model(default_model_path(), dtype=dtype).model
        if model.qmatmul is None:
            print("no quantised kernel (no compiler?)")
            return
        print(f"{dtype} activations: rows, GGUF blocks (ms), dense oneDNN (ms); min of {repeat} interleaved runs")
        for rows in (1, 2, 4, 8, 12, 16, 24, 32, 64):
            blocks_ms, dense_ms = quant_rows.time_projections(model, rows, repeat)
            print(f"  {rows:4d}   {blocks_ms:8.1f}   {dense_ms:8.1f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: both)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--context", type=int, default=1600)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                      "forward_speed.json"))
    parser.add_argument("--enforce-eager", action="store_true", help="CUDA: no decode graphs")
    parser.add_argument("--profile", choices=["prefill", "warm", "long", "decode1", "decode8"], default=None,
                        help="profile one step instead (long: 2,048 new tokens on a cached 3,456)")
    parser.add_argument("--matmuls", action="store_true",
                        help="only time all layers' projections: GGUF blocks vs the dense copy, by rows "
                             "(activations in --dtype, default both)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.matmuls:
        time_matmuls(args.repeat, [args.dtype] if args.dtype else ["float32", "bfloat16"])
        return
    steps_by_dtype: dict[str, dict[str, dict[str, float]]] = {}
    for dtype in [args.dtype] if args.dtype else ["float32", "bfloat16"]:
        loaded = load_model(default_model_path(), dtype=dtype, device=args.device)
        if getattr(loaded.model, "qmatmul", None) is not None:
            quant_rows.calibrate(loaded.model)                  # the row limit kvhive serve uses here
        num_blocks = max(8 * (args.context // BLOCK + 2), 5504 // BLOCK + 2) + 2 * (1600 // BLOCK + 2)
        runner = ModelRunner(loaded.model, loaded.config, num_blocks, BLOCK, dtype, device=args.device,
                             cuda_graphs=not args.enforce_eager, measure_attention=True)
        plans = {"prefill": prefill_plan(1600), "warm": warm_prefill_plan(1536, 64),
                 "long": warm_prefill_plan(3456, 2048),
                 "decode1": decode_plan(1, args.context), "decode8": decode_plan(8, args.context)}
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            cuda = runner.device.type == "cuda"
            runner.execute(plans[args.profile])
            sync(runner)
            with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
                runner.execute(plans[args.profile])
                sync(runner)
            sort = "cuda_time_total" if cuda else "self_cpu_time_total"
            print(prof.key_averages().table(sort_by=sort, row_limit=25))
            continue
        print(f"{dtype}: min / median of {args.repeat} runs (decode: {4 * args.repeat} steps)")
        steps = steps_by_dtype[dtype] = {}
        for n in (1024, 1600):
            steps[f"prefill {n} tokens"] = timed(runner, prefill_plan(n), args.repeat)
        runner.execute(prefill_plan(1600))                       # the prefix the warm turn reads
        steps["64 tokens on a cached 1,536-token prefix"] = timed(runner, warm_prefill_plan(1536, 64), args.repeat)
        steps["2,048 tokens on a cached 3,456-token prefix"] = timed(runner, plans["long"], args.repeat)
        for batch in (1, 8):
            steps[f"decode, batch {batch}, context {args.context}"] = timed(
                runner, decode_plan(batch, args.context), args.repeat * 4)
        for step, t in steps.items():
            print(f"  {step:45s} {t['min_ms']:8.1f} / {t['median_ms']:8.1f} ms")
    if steps_by_dtype:
        with open(args.out, "w") as f:
            json.dump({"machine": machine(), "device": args.device, "threads": args.threads,
                       "date": time.strftime("%Y-%m-%d"),
                       "command": command(__file__),
                       "steps": steps_by_dtype}, f, indent=1)


if __name__ == "__main__":
    main()
