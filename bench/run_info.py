"""What every result file records about its run: the machine and the command that produced it."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
from collections.abc import Callable


def machine() -> str:
    """One line about this machine: CPU model, its vector ISA flags, cores, OS, Python."""
    cpu, flags = "unknown CPU", ""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.readlines()
        cpu = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
        flags = " ".join(f for f in next(line for line in lines if line.startswith("flags")).split()
                         if f.startswith(("avx", "amx", "fma", "f16c")))
    except (OSError, StopIteration):
        pass
    return (f"{cpu} (flags: {flags or 'unknown'}), {os.cpu_count()} cores, {platform.system()} "
            f"{platform.release()}, Python {platform.python_version()}")


# Environment variables that change what a benchmark measures (the ISA torch and oneDNN may use,
# OpenMP's threads): a command that ran with them set names them.
COMMAND_ENV = ("DNNL_MAX_CPU_ISA", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS", "OMP_WAIT_POLICY")


def command(script: str) -> str:
    """The command line that ran ``script`` (a path under bench/), as a reader would retype it."""
    env = [f"{name}={shlex.quote(os.environ[name])}" for name in COMMAND_ENV if name in os.environ]
    return " ".join([*env, shlex.join(["python", f"bench/{os.path.basename(script)}", *sys.argv[1:]])])


def save_record(out: str, record: dict, render: Callable[[str, dict], list[str]]) -> None:
    """Write a result file (its folders made) and print how docs/benchmarks.md renders it."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    print("\n".join(render(os.path.basename(out), record)))
