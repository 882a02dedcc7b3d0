#!/usr/bin/env python3
"""TTFT of 1k / 4k / 8k-token prompts on the default model: cold recompute vs a hit from each KV tier.

    python bench/tiers_ttft.py --repeat 2          # writes bench/results/tiers_ttft.json and
                                                   # docs/tiers_ttft.png

For each size a fresh random prompt is computed cold (nothing cached anywhere) by an engine whose
tiers are CPU memory + disk + Redis (saves are write-through), then served again by engines that
each see one place only: the same engine's device pool; a new engine (empty device pool) over the
CPU tier alone, the disk tier alone, the Redis tier alone; and "restart": a new DiskStore on the
same directory with its index snapshot deleted (rebuilt by scanning, as after SIGKILL). TTFT is
wall time from add_request to the first token out of ``LLMEngine.step`` (max_tokens=1), the median
of --repeat runs. The page cache stays warm across the "restart" (a process restart, not a reboot).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import tempfile
import time

import torch
from run_info import command, machine

from kvhive.config import CacheConfig, EngineConfig, SchedulerConfig
from kvhive.core.model_files import default_model_path
from kvhive.core.tokenizer import Tokenizer
from kvhive.engine.llm_engine import LLMEngine
from kvhive.model.loader import load_model
from kvhive.request import SamplingParams
from kvhive.store import DiskStore, MemoryStore, Tier, TieredStore

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
SOURCES = ("cold", "device", "cpu", "disk", "redis", "restart (disk)")


def ttft(engine: LLMEngine, request_id: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first token, and the cached tokens reported."""
    start = time.perf_counter()
    engine.add_request(request_id, prompt, ONE_TOKEN)
    while True:
        for out in engine.step():
            if out.new_token_ids:
                elapsed = time.perf_counter() - start
                while engine.has_unfinished():
                    engine.step()
                return elapsed, out.num_cached_tokens


def start_redis(workdir: str) -> tuple[subprocess.Popen | None, str | None]:
    if shutil.which("redis-server") is None:
        return None, None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", workdir],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    return proc, f"redis://127.0.0.1:{port}/0"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 8000])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", default="bench/results/tiers_ttft.json")
    parser.add_argument("--plot", default="docs/tiers_ttft.png")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = default_model_path()
    loaded = load_model(path, dtype="float32", device="cpu")
    tokenizer = Tokenizer.from_model_path(path)
    num_blocks = max(args.sizes) // 16 + 64
    config = EngineConfig(model_path=path, cache=CacheConfig(num_blocks=num_blocks),
                          scheduler=SchedulerConfig(max_model_len=8192))
    workdir = tempfile.mkdtemp(prefix="kvhive-tiers-bench-")
    redis_proc, redis_url = start_redis(workdir)
    memory = Tier("cpu", MemoryStore(4 << 30))
    disk = Tier("disk", DiskStore(os.path.join(workdir, "disk"), 8 << 30), write_through=True)
    tiers = [memory, disk]
    if redis_url:
        from kvhive.store.redis import RedisStore

        tiers.append(Tier("redis", RedisStore(redis_url, timeout_s=5.0), write_through=True))

    def engine_over(*use: Tier) -> LLMEngine:
        return LLMEngine(config, loaded=loaded, tokenizer=tokenizer, store=TieredStore(list(use)))

    def drop(engine: LLMEngine) -> None:
        engine.connector_worker.close()        # leave the shared tiers open

    rng = random.Random(0)
    results: dict[str, dict[str, dict[str, float]]] = {}
    for n in args.sizes:
        row: dict[str, list[tuple[float, int]]] = {s: [] for s in SOURCES}
        for rep in range(args.repeat):
            prompt = [rng.randrange(100, 40000) for _ in range(n)]
            full = engine_over(*tiers)
            row["cold"].append(ttft(full, f"cold{n}-{rep}", prompt))
            full.connector_worker.wait_for_save()
            row["device"].append(ttft(full, f"dev{n}-{rep}", prompt))
            drop(full)
            for name, tier in (("cpu", memory), ("disk", disk), ("redis", tiers[-1] if redis_url else None)):
                if tier is None:
                    continue
                engine = engine_over(tier)
                row[name].append(ttft(engine, f"{name}{n}-{rep}", prompt))
                drop(engine)
            disk.store.close()                   # "restart": the index is rebuilt from the segments
            os.unlink(os.path.join(workdir, "disk", "index.snapshot"))
            disk = Tier("disk", DiskStore(os.path.join(workdir, "disk"), 8 << 30), write_through=True)
            tiers[1] = disk
            fresh_memory = Tier("cpu", MemoryStore(4 << 30))
            engine = engine_over(fresh_memory, disk)
            row["restart (disk)"].append(ttft(engine, f"restart{n}-{rep}", prompt))
            drop(engine)
        results[str(n)] = {s: {"ttft_s": statistics.median(t for t, _ in v),
                               "cached_tokens": min(c for _, c in v)} for s, v in row.items() if v}
        print(n, {s: round(r["ttft_s"], 3) for s, r in results[str(n)].items()}, flush=True)
    for tier in tiers:
        tier.store.close()
    if redis_proc is not None:
        redis_proc.kill()
    shutil.rmtree(workdir, ignore_errors=True)
    meta = {"machine": machine(), "threads": args.threads, "model": "SmolLM2-135M-Instruct (float32)",
            "repeat": args.repeat, "device": "cpu", "date": time.strftime("%Y-%m-%d"),
            "command": command(__file__)}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)
    plot(args.plot, results)


def plot(path: str, results: dict) -> None:
    """A grouped bar plot: TTFT per prompt size, one bar per place the KV comes from."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(results)
    sources = [s for s in SOURCES if all(s in results[n] for n in sizes)]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(sources)
    for i, s in enumerate(sources):
        ax.bar([j + i * width for j in range(len(sizes))], [results[n][s]["ttft_s"] for n in sizes], width,
               label=s)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))], [f"{n} tokens" for n in sizes])
    ax.set_ylabel("TTFT (s)")
    ax.set_yscale("log")
    ax.set_title("TTFT by where the prompt's KV comes from (SmolLM2-135M, CPU)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
