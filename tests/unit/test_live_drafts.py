"""Method "history" drafting from the tenant's running requests: the index's lookup of another
sequence's suffix against a scan, the tenant boundary, the bound on peers looked up, and the
peers dropped when they finish."""

from __future__ import annotations

import random

import pytest
from test_tenant_history import brute_force

from kvhive.core.speculative_config import SpeculativeConfig
from kvhive.engine.speculative.draft_proposals import MAX_LIVE_PEERS, DraftProposer
from kvhive.engine.speculative.ngram_index import NgramIndex
from kvhive.request import Request, SamplingParams


@pytest.mark.parametrize("seed", range(4))
def test_follow_finds_what_a_scan_of_the_sequence_finds(seed: int) -> None:
    rng = random.Random(seed)
    tokens = [rng.randrange(3) for _ in range(30)]
    index = NgramIndex(2, 4, tokens)
    for _ in range(20):
        context = [rng.randrange(3) for _ in range(rng.randint(1, 7))]
        min_match = rng.randint(0, 5)
        expected = brute_force([tokens], context, max(2, min_match), 4, 3)
        assert index.follow(context, 3, min_match) == expected


def history_proposer(method: str = "history") -> DraftProposer:
    return DraftProposer(SpeculativeConfig(num_speculative_tokens=3, method=method, prompt_lookup_min=2,
                                           prompt_lookup_max=3))


def req(rid: str, prompt: list[int], salt: str | None) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=50), cache_salt=salt)


def test_a_request_drafts_from_its_tenants_running_request_and_never_anothers() -> None:
    proposer = history_proposer()
    leader = req("lead", [10, 11, 12, 13, 14, 15], "key:a")
    assert proposer.propose(leader, 8) == []             # now running, its tokens indexed
    assert proposer.propose(req("same", [1, 2, 10, 11], "key:a"), 8) == [12, 13, 14]
    assert proposer.propose(req("other", [1, 2, 10, 11], "key:b"), 8) == []
    assert proposer.propose(req("anon", [1, 2, 10, 11], None), 8) == []
    assert history_proposer("ngram").propose(req("x", [10, 11, 12, 13, 14, 15], "key:a"), 8) == []


def test_a_finished_peer_is_no_longer_looked_up_live() -> None:
    proposer = history_proposer()
    leader = req("lead", [10, 11, 12, 13, 14, 15], "key:a")
    proposer.propose(leader, 8)
    leader.append_output_token(16)
    proposer.propose(leader, 8)                          # its index now holds the output token
    proposer.finish(leader)
    assert proposer._live == {}
    # Its tokens now draft from the finished history (the same text), not from a stale live index.
    assert proposer.propose(req("next", [1, 2, 14, 15], "key:a"), 8) == [16]
    proposer.finish(req("next", [1, 2, 14, 15], "key:a"))
    assert proposer._live == {}


def test_only_the_latest_peers_are_looked_up() -> None:
    proposer = history_proposer()
    oldest = req("oldest", [20, 21, 22, 23], "key:a")
    proposer.propose(oldest, 8)
    for i in range(MAX_LIVE_PEERS - 1):
        proposer.propose(req(f"p{i}", [100 + i, 101 + i], "key:a"), 8)
    assert proposer.propose(req("q1", [1, 20, 21], "key:a"), 8) == [22, 23]   # q1 is now the 9th running
    assert proposer.propose(req("q2", [2, 20, 21], "key:a"), 8) == []         # 8 later peers first
    proposer.finish(req("p0", [], "key:a"))
    assert proposer.propose(req("q2", [2, 20, 21], "key:a"), 8) == [22, 23]
