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


@pytest.mark.parametrize("says_idle", [True, False])
def test_cores_others_use_while_the_engine_idles_do_not_shrink_its_team(says_idle: bool) -> None:
    """Two servers on one host take turns: this engine answers a request, idles while the other
    answers one, runs a one-step request, idles again, then answers the next. The readings across
    its idle time are not contention; without ``idle`` two of them in a row shrink the team for
    the first half second of its next request (as two servers taking turns on one host showed)."""
    clock, sizes = FakeClock(), []
    gov = ThreadGovernor(2, sizes.append, interval_s=0.5, cores=2, read=clock, clock=clock.seconds)

    def work(seconds: float) -> None:
        for _ in range(round(seconds / 0.05)):          # steps of 50 ms, each after an adjust
            gov.adjust()
            clock.advance(0.05, others=0.0, own=2.0)
        if says_idle:
            gov.idle()

    for _ in range(3):
        work(0.6)                                        # this engine's request, alone
        clock.advance(1.5, others=2.0, own=0.0)          # the other server's request
        work(0.05)                                       # a one-step request (a prompt cached ahead)
        clock.advance(1.5, others=2.0, own=0.0)
    work(0.6)
    assert sizes == ([] if says_idle else [1, 2] * 3)


def test_a_neighbour_busy_while_the_engine_works_still_shrinks_it_across_idle_gaps() -> None:
    clock, sizes = FakeClock(), []
    gov = ThreadGovernor(2, sizes.append, interval_s=0.5, cores=2, read=clock, clock=clock.seconds)
    for _ in range(2):                                   # two bursts of work, a neighbour busy throughout
        for _ in range(2):
            clock.advance(0.6, others=1.0, own=1.0)
            gov.adjust()
        gov.idle()
        clock.advance(2.0, others=1.0, own=0.0)
        gov.adjust()
    assert sizes == [1] and gov.threads == 1             # shrunk in the first burst, kept in the second
    clock.advance(0.6, others=0.0, own=1.0)              # the neighbour leaves
    assert gov.adjust() == 2


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


@pytest.mark.skipif(read_cpu_ticks() is None or (os.cpu_count() or 1) < 2, reason="needs Linux /proc and 2 cores")
def test_a_real_process_busy_only_while_the_engine_idled_takes_nothing() -> None:
    cores = len(os.sched_getaffinity(0))
    sizes: list[int] = []
    gov = ThreadGovernor(cores, sizes.append, interval_s=0.5)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    try:
        gov.adjust()
        gov.idle()                  # the engine waits while the burners hold every core
        time.sleep(1.2)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    for _ in range(3):              # working alone again
        gov.adjust()
        time.sleep(0.6)
    assert sizes == [] and gov.adjust() == cores, gov.others
