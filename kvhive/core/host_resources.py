"""What this host gives the process, read once where a budget is checked (torch-free): the CPUs it
may run on, the memory it may use (the machine's, or its cgroup's limit), and whether the KV budgets
in CPU memory fit that memory."""

from __future__ import annotations

import os
from collections.abc import Sequence


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# The most of this machine's memory the KV in CPU memory may be given (the CPU tier, and the device
# pool when the engine runs on the CPU): the model, the server and the OS need the rest. A budget
# over it would be taken lazily and end in the kernel's OOM killer, not in an error at start.
MAX_KV_MEMORY_SHARE = 0.9
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def usable_memory_bytes() -> int | None:
    """The memory this process may use: the machine's, or its cgroup's limit where that is lower;
    None where the machine's cannot be read."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    for path in _CGROUP_LIMITS:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def gib_text(gib: float) -> str:
    """A GiB figure for a message: whole GiB with thousands separators from 10 up, else two digits."""
    return f"{gib:,.0f}" if gib >= 10 else f"{gib:.2g}"


def kv_memory_problem(budgets: Sequence[tuple[str, float]], memory_bytes: int | None) -> str | None:
    """Why the KV budgets in CPU memory (``(what, GiB)``: the CPU tier's flag, and the device pool's
    when the pool is in CPU memory) cannot fit ``memory_bytes``; None when they do or the memory
    is unknown."""
    asked = sum(gib for _, gib in budgets)
    if memory_bytes is None or asked <= MAX_KV_MEMORY_SHARE * memory_bytes / 2**30:
        return None
    named = [what for what, gib in budgets if gib > 0]
    verb = "asks" if len(named) == 1 else "ask"
    return (f"{' and '.join(named)} {verb} for {gib_text(asked)} GiB of KV in CPU memory; this machine gives this "
            f"process {memory_bytes / 2**30:.1f} GiB, and at most {MAX_KV_MEMORY_SHARE:.0%} of it "
            f"({MAX_KV_MEMORY_SHARE * memory_bytes / 2**30:.1f} GiB) may hold KV (the model, the server and "
            f"the OS need the rest)")
