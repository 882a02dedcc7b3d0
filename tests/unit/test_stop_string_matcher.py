"""The stop-string matcher: text that may begin a stop string is held back until it does or cannot."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhive.server.stop import StopStringMatcher


@pytest.mark.parametrize(("stops", "deltas", "sent", "stopped"), [
    (["END"], ["abc E", "N", "D more"], ["abc ", "", ""], True),        # held back, then cut
    (["END"], ["abc E", "Nx"], ["abc ", "ENx"], False),                 # held back, then released
    (["ab"], ["a", "a", "b"], ["", "a", ""], True),                     # overlapping partial match
    (["xyz", "y"], ["xy"], ["x"], True),                                # the first stop to complete wins
    ([], ["no", " stops"], ["no", " stops"], False),
])
def test_stop_string_matcher(stops: list[str], deltas: list[str], sent: list[str], stopped: bool) -> None:
    matcher = StopStringMatcher(stops)
    assert [matcher.feed(d) for d in deltas] == sent
    assert matcher.stopped is stopped
    assert matcher.flush() == ""


@pytest.mark.parametrize(("stops", "deltas", "sent"), [
    (["END"], ["abc E", "N", "D more"], ["abc ", "", "END"]),           # the stop string ends the text
    (["xyz", "y"], ["xy"], ["xy"]),                                     # the first match, kept
    (["ab", "abc"], ["zabc"], ["zab"]),                                 # two at one place: the one completed first
])
def test_include_stop_keeps_the_matched_stop_string(stops: list[str], deltas: list[str], sent: list[str]) -> None:
    matcher = StopStringMatcher(stops, include_stop=True)
    assert [matcher.feed(d) for d in deltas] == sent
    assert matcher.stopped and matcher.flush() == ""


class _Reference:
    """The matcher's meaning written plainly: search the whole held-back text for every stop and
    hold back the longest suffix that begins one (quadratic, for comparison only)."""

    def __init__(self, stops: list[str], include_stop: bool) -> None:
        self.stops, self.include_stop, self.pending, self.stopped = [s for s in stops if s], include_stop, "", False

    def feed(self, delta: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return delta
        self.pending += delta
        hits = [(i, len(s)) for s in self.stops if (i := self.pending.find(s)) >= 0]
        if hits:
            self.stopped = True
            start, length = min(hits)
            out, self.pending = self.pending[:start + length if self.include_stop else start], ""
            return out
        keep = next((k for k in range(len(self.pending), 0, -1)
                     if any(len(s) > k and s.startswith(self.pending[-k:]) for s in self.stops)), 0)
        out, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return "" if self.stopped else out


_TEXT = st.text(alphabet="abc", max_size=12)


@settings(max_examples=400, deadline=None)
@given(stops=st.lists(_TEXT, max_size=4), deltas=st.lists(_TEXT, max_size=8), include=st.booleans())
def test_the_matcher_sends_what_the_plain_search_sends(stops: list[str], deltas: list[str], include: bool) -> None:
    matcher, reference = StopStringMatcher(stops, include_stop=include), _Reference(stops, include)
    assert [matcher.feed(d) for d in deltas] == [reference.feed(d) for d in deltas]
    assert (matcher.stopped, matcher.flush()) == (reference.stopped, reference.flush())


def test_the_work_per_delta_is_linear_in_the_delta(monkeypatch: pytest.MonkeyPatch) -> None:
    """64 stop strings of 1,024 characters built to match almost to their end, fed one character at a
    time: the matcher compares each character with each stop a bounded number of times overall."""
    stops = ["a" * 1023 + chr(0x100 + i) for i in range(64)]
    compared = 0

    class Counting(str):
        def __getitem__(self, i):
            nonlocal compared
            compared += 1
            return str.__getitem__(self, i)

    matcher = StopStringMatcher([Counting(s) for s in stops])
    text = ("a" * 1023 + "z") * 8
    sent = "".join(matcher.feed(c) for c in text) + matcher.flush()
    assert sent == text and not matcher.stopped
    # Each character moves each stop's state up by one at most, so its fall-backs are bounded by the
    # characters too: a few reads per character and stop, against ~1,000 for a rescan of the tail.
    assert compared <= 4 * len(text) * len(stops)
