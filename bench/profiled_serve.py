#!/usr/bin/env python3
"""``kvhive serve`` with a torch profiler window opened and closed by files, for a trace of a serving
process (``bench/pd_vs_colocated.py --profile-dir`` runs its prefill and decode instances so).

    python bench/profiled_serve.py --trace DIR/prefill_trace.json --control DIR -- --port 8001 ...

Everything after ``--`` goes to ``kvhive serve``. The profiler (CPU ops of every thread, and CUDA
kernels and copies where CUDA is present) starts when ``DIR/start`` appears (``--trace`` +
``.started`` then says it runs) and stops when ``DIR/stop`` appears; the Chrome trace (open it in
Perfetto or chrome://tracing) is written to ``--trace``, then ``--trace`` + ``.done`` marks it
complete.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

POLL_S = 0.05


def wait_for_file(path: str) -> None:
    """Return once ``path`` exists."""
    while not os.path.exists(path):
        time.sleep(POLL_S)


def all_threads():  # noqa: ANN201 - a torch._C._profiler._ExperimentalConfig, or None
    """The profiler setting that records every thread's ops (the engine steps in its own thread),
    where this torch has it; else None (the window's own thread, and CUDA activity)."""
    from torch._C._profiler import _ExperimentalConfig

    try:
        return _ExperimentalConfig(profile_all_threads=True)
    except TypeError:
        return None


def profile_window(trace: str, control: str) -> None:
    """Profile from ``control/start`` to ``control/stop`` and write the trace."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    wait_for_file(os.path.join(control, "start"))
    prof = profile(activities=activities, experimental_config=all_threads())
    prof.start()
    pathlib.Path(trace + ".started").touch()
    wait_for_file(os.path.join(control, "stop"))
    prof.stop()
    prof.export_chrome_trace(trace)
    pathlib.Path(trace + ".done").touch()


def main() -> int:
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", required=True, help="the Chrome trace file to write")
    ap.add_argument("--control", required=True, help="directory whose start and stop files open and close the window")
    args = ap.parse_args(argv[:cut])
    threading.Thread(target=profile_window, args=(args.trace, args.control), daemon=True).start()
    from kvhive.cli import main as kvhive_main

    return kvhive_main(["serve", *argv[cut + 1:]])


if __name__ == "__main__":
    sys.exit(main())
