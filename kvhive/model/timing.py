"""Which of a few ways to do the same work is fastest on this machine, timed in place."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch


def min_times(fns: Sequence[Callable[[], object]], repeat: int,
              clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Each function's fastest of ``repeat`` runs in seconds, after one warm-up run each; the
    functions take turns, so a noisy moment on a shared host hits them alike. ``clock``: wall time,
    or e.g. ``time.process_time`` (CPU time, steadier on a busy host for one-thread runs)."""
    best = [float("inf")] * len(fns)
    with torch.inference_mode():
        for fn in fns:
            fn()
        for _ in range(repeat):
            for i, fn in enumerate(fns):
                started = clock()
                fn()
                best[i] = min(best[i], clock() - started)
    return best
