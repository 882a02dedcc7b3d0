"""The thread team follows the cores other processes leave free."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kvhive.model.threads import ThreadGovernor, read_cpu_ticks

TICKS = os.sysconf("SC_CLK_TCK")


class FakeClock:
    """Readings where, each interval, others use ``others`` cores and this process ``own`` cores."""

    def __init__(self) -> None:
        self.t, self.busy, self.own = 0.0, 0, 0
        self.reads = 0

    def advance(self, seconds: float, others: float, own: float) -> None:
        self.t += seconds
        self.busy += round((others + own) * seconds * TICKS)
        self.own += round(own * seconds * TICKS)

    def __call__(self) -> tuple[float, int, int]:
        self.reads += 1
        return self.t, self.busy, self.own

    def seconds(self) -> float:
        return self.t


def test_the_team_shrinks_under_a_busy_neighbour_and_grows_back() -> None:
    clock, sizes = FakeClock(), []
    gov = ThreadGovernor(4, sizes.append, interval_s=0.5, cores=4, read=clock, clock=clock.seconds)
    clock.advance(0.2, others=0.0, own=4.0)
    assert gov.adjust() == 4 and sizes == []            # inside the interval: no reading
    assert clock.reads == 1                             # only the first, at construction
    clock.advance(0.5, others=1.0, own=3.0)             # one core taken: once is not yet a trend
    assert gov.adjust() == 4 and sizes == []
    clock.advance(0.5, others=1.0, own=3.0)             # taken again
    assert gov.adjust() == 3 and sizes == [3]
    clock.advance(0.5, others=0.5, own=3.0)             # half a core taken: within the hysteresis
    assert gov.adjust() == 3
    clock.advance(0.5, others=3.5, own=0.5)             # the machine is nearly full...
    assert gov.adjust() == 3
    clock.advance(0.5, others=2.2, own=0.5)             # ...and still mostly: the lesser cut of the two
    assert gov.adjust() == 2
    clock.advance(0.5, others=0.0, own=1.0)             # neighbours gone: all cores again, at once
    assert gov.adjust() == 4 and sizes == [3, 2, 4]


def test_a_burst_of_one_reading_keeps_the_team() -> None:
    clock, sizes = FakeClock(), []
    gov = ThreadGovernor(2, sizes.append, interval_s=0.5, cores=2, read=clock, clock=clock.seconds)
    for others in (0.9, 0.0, 0.9, 0.1, 1.0, 0.0):       # a client starting now and then
        clock.advance(0.7, others=others, own=2.0 - others)
        assert gov.adjust() == 2
    assert sizes == []


def test_never_beyond_the_configured_count_nor_below_one() -> None:
    clock = FakeClock()
    gov = ThreadGovernor(2, lambda n: None, cores=8, read=clock, clock=clock.seconds)
    clock.advance(1.0, others=0.0, own=2.0)
    assert gov.adjust() == 2
    clock.advance(1.0, others=20.0, own=0.1)
    assert gov.adjust() == 2
    clock.advance(1.0, others=20.0, own=0.1)
    assert gov.adjust() == 1


def test_without_readings_the_team_stays() -> None:
    gov = ThreadGovernor(2, lambda n: None, read=lambda: None)
    assert gov.adjust() == 2


@pytest.mark.skipif(read_cpu_ticks() is None or (os.cpu_count() or 1) < 2, reason="needs Linux /proc and 2 cores")
def test_a_real_busy_process_takes_a_thread() -> None:
    cores = len(os.sched_getaffinity(0))
    sizes: list[int] = []
    gov = ThreadGovernor(cores, sizes.append, interval_s=0.5)
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.6)
        gov.adjust()
        time.sleep(0.6)
        assert gov.adjust() <= cores - 1, gov.others
        assert gov.others > 0.5
    finally:
        burner.kill()
        burner.wait()
