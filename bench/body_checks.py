"""The body check of the replicas and the gateway on each hostile class, in process.

    python bench/body_checks.py [--size 33554432] [--limit-s 30] [CLASS ...]

For each class of ``tests/support/hostile_bodies.py`` at ``--size`` bytes: the time of
``kvhive.core.json_body.json_object`` (the depth, size, UTF-8, number and lone-surrogate checks and
the parse) run on a worker thread as the servers run it, the longest gap of an event loop ticking
every millisecond meanwhile (the time the check held the GIL in one piece), and its verdict. Each
class runs in a process of its own, stopped after ``--limit-s``.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import sys
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))

from support.hostile_bodies import SIZED, hostile_bodies  # noqa: E402

from kvhive.core.json_body import json_object  # noqa: E402


async def check_while_ticking(raw: bytes) -> tuple[float, float, str]:
    """(seconds the check took, longest gap between loop ticks, its verdict)."""
    gaps, done = [0.0], False

    async def tick() -> None:
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.005)
    start = time.perf_counter()
    try:
        await asyncio.to_thread(json_object, raw)
        verdict = "accepted"
    except ValueError as exc:
        verdict = f"{type(exc).__name__}: {exc}"
    took = time.perf_counter() - start
    done = True
    await ticker
    return took, max(gaps), verdict


def one_class(name: str, size: int, out: Any) -> None:
    out.put(asyncio.run(check_while_ticking(hostile_bodies(size)[name])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=32 << 20)
    parser.add_argument("--limit-s", type=float, default=30.0)
    parser.add_argument("classes", nargs="*", default=list(SIZED))
    args = parser.parse_args()
    print(f"{'class':38s} {'check':>10s} {'loop gap':>10s}  verdict ({args.size} bytes)")
    for name in args.classes:
        out: Any = multiprocessing.Queue()
        worker = multiprocessing.Process(target=one_class, args=(name, args.size, out))
        worker.start()
        worker.join(args.limit_s)
        if worker.is_alive():
            worker.kill()
            print(f"{name:38s} {'>' + str(int(args.limit_s)) + ' s':>10s}")
            continue
        took, gap, verdict = out.get()
        print(f"{name:38s} {took * 1000:8.1f} ms {gap * 1000:7.1f} ms  {ascii(verdict)[:60]}")


if __name__ == "__main__":
    main()
