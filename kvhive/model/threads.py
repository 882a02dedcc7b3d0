"""The CPU thread team sized to the cores other processes leave free.

A step splits each op over the team statically, so a step is as slow as its slowest thread: when
another process holds one of the cores, the thread sharing that core is descheduled for whole time
slices and every barrier of the step waits for it (a 2-core host with one busy neighbour measured
several times slower decode with 2 threads than with 1). ``ThreadGovernor`` reads, between steps
and at most every ``interval_s``, how much CPU time the whole machine and this process used since
the last reading (Linux ``/proc/stat`` and ``/proc/self/stat``); the difference is what others used,
and the team gets the cores they left (at least 1, at most the configured count). It shrinks only
when two readings in a row find a core taken: a burst of a second (a client process starting, a
benchmark driver tokenizing its prompts) would otherwise halve the team for the step that serves
that client's first requests, and a step at one thread takes twice as long.

Only time the engine works is read: when a step leaves it nothing to do the engine says so
(``idle``), and the first step after that starts a new reading instead of judging the last one.
While it idles, other processes may use every core without slowing it (another server on the same
host answering its own requests), and a reading across that time would shrink the team for the
first half second of the next request.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from kvhive.core.host_resources import usable_cpus

logger = logging.getLogger(__name__)

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_busy_ticks() -> int | None:
    """Ticks every CPU spent not idle (user, nice, system, irq, softirq, steal) since boot."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    return user + nice + system + irq + softirq + steal


def read_cpu_ticks() -> tuple[float, int, int] | None:
    """(monotonic seconds, the machine's busy ticks, this process's ticks); None off Linux."""
    busy, own = _machine_busy_ticks(), _own_ticks()
    return None if busy is None or own is None else (time.monotonic(), busy, own)


def _own_ticks() -> int | None:
    """Ticks this process's threads ran (user + system)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[11]) + int(fields[12])          # utime, stime (fields 14 and 15 of stat)


class ThreadGovernor:
    """Keeps the thread team at the cores other processes leave free (1..max_threads)."""

    def __init__(self, max_threads: int, set_threads: Callable[[int], None], interval_s: float = 0.5,
                 cores: int | None = None,
                 read: Callable[[], tuple[float, int, int] | None] = read_cpu_ticks,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``read`` gives (seconds, machine busy ticks, own ticks), ``read_cpu_ticks`` by default;
        ``clock`` is the seconds clock of those readings (checked first, so that a step between
        readings costs no file read)."""
        self.max_threads = max_threads
        self.threads = max_threads
        self._set_threads = set_threads
        self.interval_s = interval_s
        if cores is None:
            cores = usable_cpus()
        self.cores = cores
        self._read = read
        self._clock = clock
        self._last = read()
        self.others = 0.0               # cores other processes used over the last interval
        self._shrink: int | None = None  # the last reading's smaller team, if it called for one
        self._idle = False              # the engine ran out of work since the last step

    def idle(self) -> None:
        """The engine has no work left: the next ``adjust`` starts a new reading rather than read
        the time it idled as other processes taking its cores."""
        self._idle = True

    def adjust(self) -> int:
        """Re-size the team if ``interval_s`` has passed since the last reading; the team's size."""
        if self._idle:
            self._idle = False
            self._last = self._read()
            return self.threads
        if self._last is None or self._clock() - self._last[0] < self.interval_s:
            return self.threads
        now = self._read()
        if now is None:
            return self.threads
        elapsed = (now[0] - self._last[0]) * _CLOCK_TICKS
        self.others = max(0.0, ((now[1] - self._last[1]) - (now[2] - self._last[2])) / elapsed)
        self._last = now
        free = self.cores - self.others
        # Hysteresis: shrink once a core is mostly taken over two readings in a row (a neighbour's
        # burst of a second, a client starting up, keeps the team), by the lesser of the two
        # readings' cuts; grow back at the first reading that finds a core mostly free.
        shrink = None
        if free < self.threads - 0.6:
            shrink = max(1, int(free + 0.4))
            target = self.threads if self._shrink is None else max(shrink, self._shrink)
        elif free > self.threads + 0.6:
            target = min(self.max_threads, int(free + 0.4))
        else:
            target = self.threads
        self._shrink = shrink
        target = max(1, min(self.max_threads, target))
        if target != self.threads:
            logger.info("other processes use %.1f of %d cores: %d compute thread%s", self.others, self.cores,
                        target, "" if target == 1 else "s")
            self._set_threads(target)
            self.threads = target
        return self.threads
