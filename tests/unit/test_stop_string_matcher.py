"""The stop-string matcher: text that may begin a stop string is held back until it does or cannot."""

from __future__ import annotations

import pytest

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
