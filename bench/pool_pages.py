#!/usr/bin/env python3
"""Decode steps with the KV pool on 2 MiB huge pages against the same pool on 4 KiB pages.

Two ModelRunners of the default model share its weights; each gets a pool of --kv-cache-gb (the
server's default size). The first takes the pool as the server does (``kvhive.model.host_pages``:
huge pages advised where Linux allows); the second is built the way a host without huge pages
builds it (the advice refused, ordinary pages). Each decode step below runs on both in turn,
--pairs times, with block tables drawn at random from the whole pool (as a long-running server's
free list hands them out); the figure is the median of the per-pair time ratios, so a host that
slows down for a minute slows both sides of a pair.

    python bench/pool_pages.py                 # writes bench/results/pool_pages.json

Steps: eight requests at 600 and 1,200 tokens of context, one at 1,600 (--threads threads).
Without huge pages on this host (THP ``never``, not Linux) both runners get ordinary pages and the
result says so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import time
from collections.abc import Iterator

import torch
from run_info import command, machine

from kvhive.core.model_files import default_model_path
from kvhive.engine.runner import ModelRunner
from kvhive.engine.step import ScheduledSeq, StepPlan
from kvhive.model import cpu, host_pages
from kvhive.model.loader import load_model
from kvhive.request import SamplingParams

HERE = os.path.dirname(os.path.abspath(__file__))
BLOCK = 16
STEPS = ((8, 600), (8, 1200), (1, 1600))        # (requests, tokens of context each)


@contextlib.contextmanager
def advice_refused() -> Iterator[None]:
    """Build as a host without huge pages would: ``madvise`` fails."""
    advise = host_pages._madvise
    host_pages._madvise = lambda address, length: False
    try:
        yield
    finally:
        host_pages._madvise = advise


def decode_plan(requests: int, context: int, num_blocks: int, rng: random.Random) -> StepPlan:
    """One decode token for each request, its blocks anywhere in the pool."""
    per_request = context // BLOCK + 1
    blocks = rng.sample(range(num_blocks), requests * per_request)
    return StepPlan([ScheduledSeq(f"d{i}", [rng.randrange(10, 40000)], context,
                                  blocks[i * per_request:(i + 1) * per_request], True, SamplingParams(temperature=0))
                     for i in range(requests)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-cache-gb", type=float, default=2.0)
    ap.add_argument("--pairs", type=int, default=31)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--cpu-isa", default="auto")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "pool_pages.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    isa = cpu.detect().level(args.cpu_isa)
    loaded = load_model(default_model_path(), dtype="float32", isa=isa)
    num_blocks = int(args.kv_cache_gb * 2**30) // ModelRunner.kv_bytes_per_block(loaded.config, BLOCK, "float32")
    huge = ModelRunner(loaded.model, loaded.config, num_blocks=num_blocks, block_size=BLOCK, dtype="float32", isa=isa)
    with advice_refused():
        plain = ModelRunner(loaded.model, loaded.config, num_blocks=num_blocks, block_size=BLOCK, dtype="float32",
                            isa=isa)
    rng, steps = random.Random(0), []
    with torch.inference_mode():
        for requests, context in STEPS:
            plan = decode_plan(requests, context, num_blocks, rng)
            for runner in (plain, huge):
                runner.execute(plan)                     # warm-up
            times: dict[str, list[float]] = {"plain": [], "huge": []}
            for _ in range(args.pairs):
                for side, runner in (("plain", plain), ("huge", huge)):
                    start = time.perf_counter()
                    runner.execute(plan)
                    times[side].append(time.perf_counter() - start)
            steps.append({"requests": requests, "context": context,
                          "plain_ms": statistics.median(times["plain"]) * 1e3,
                          "huge_ms": statistics.median(times["huge"]) * 1e3,
                          "ratio": statistics.median([h / p for h, p in zip(times["huge"], times["plain"], strict=True)])})
            print(steps[-1], flush=True)
    record = {"machine": machine(), "command": command(__file__), "date": time.strftime("%Y-%m-%d"),
              "cpu_isa": isa, "threads": args.threads, "pairs": args.pairs, "num_blocks": num_blocks,
              "pool_gib": huge.pool_bytes() / 2**30,
              "pages": {"huge": huge.paths()["kv_pool"], "plain": plain.paths()["kv_pool"]}, "steps": steps}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
