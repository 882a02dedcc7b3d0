"""How a request starts drafting: its tenant's acceptance prior (per tenant, bounded, token-weighted
and decaying) and the shortest n-gram match, which rises after drafts that accept nothing until the
request's first accepted draft."""

from __future__ import annotations

import random

import pytest
from support.scheduler_parts import make_request
from test_speculative_drafting import brute_force_proposal
from test_tenant_history import brute_force

from kvhive.core.speculative_config import SpeculativeConfig
from kvhive.engine.speculative.acceptance_prior import DEFAULT_PRIOR, AcceptancePriors
from kvhive.engine.speculative.draft_length import DraftLength
from kvhive.engine.speculative.draft_proposals import DraftProposer
from kvhive.engine.speculative.ngram_index import NgramIndex
from kvhive.engine.speculative.tenant_history import HistoryStore
from kvhive.request import Request, SamplingParams

# ------------------------------------------------------------------ the tenant's prior


def test_a_tenant_not_seen_starts_at_the_default_and_a_request_that_drafted_nothing_changes_nothing() -> None:
    priors = AcceptancePriors()
    assert priors.prior("a") == DEFAULT_PRIOR == 1.0
    priors.record("a", 0, 0)
    assert len(priors) == 0 and priors.prior("a") == 1.0
    with pytest.raises(ValueError, match="accepted"):
        priors.record("a", 2, 3)
    with pytest.raises(ValueError, match="max_tenants"):
        AcceptancePriors(0)


def test_the_prior_weighs_requests_by_their_draft_tokens_and_lets_older_ones_fade() -> None:
    priors = AcceptancePriors()
    priors.record("t", 40, 0)
    priors.record("t", 2, 2)               # few tokens: the 40 rejected ones still weigh more
    assert priors.prior("t") == pytest.approx(2 / 22)
    for _ in range(12):                    # later requests that accept everything take over
        priors.record("t", 10, 10)
    assert priors.prior("t") > 0.99


def test_one_tenants_acceptance_never_moves_anothers_prior() -> None:
    priors = AcceptancePriors()
    priors.record("key:a", 30, 0)
    priors.record(None, 10, 5)
    assert priors.prior("key:a") == 0.0 and priors.prior(None) == 0.5
    assert priors.prior("key:b") == 1.0


def test_the_table_keeps_only_the_tenants_updated_most_recently() -> None:
    priors = AcceptancePriors(max_tenants=2)
    priors.record("a", 10, 0)
    priors.record("b", 10, 1)
    priors.record("a", 10, 0)              # "a" updated again: "b" is now the oldest
    priors.record("c", 10, 2)
    assert len(priors) == 2
    assert priors.prior("b") == DEFAULT_PRIOR and priors.prior("a") == 0.0 and priors.prior("c") == 0.2


def salted(rid: str, prompt: list[int], salt: str | None) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=50), cache_salt=salt)


def test_a_tenants_next_request_starts_from_what_its_finished_requests_accepted() -> None:
    proposer = DraftProposer(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2,
                                               prompt_lookup_max=2))
    prompt = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    first = salted("a1", prompt, "key:a")
    assert proposer.propose(first, 8) == [3, 4, 5, 6]              # full length: nothing seen yet
    proposer.record("a1", 4, 0)
    proposer.finish(first)
    assert proposer.priors.prior("key:a") == 0.0
    assert proposer.propose(salted("a2", prompt, "key:a"), 8) == [3]   # starts stopped: a one-token probe
    assert proposer.draft_length("a2").rate == 0.0
    assert proposer.propose(salted("b1", prompt, "key:b"), 8) == [3, 4, 5, 6]
    assert proposer.propose(salted("n1", prompt, None), 8) == [3, 4, 5, 6]
    second = salted("a3", prompt, "key:a")                          # a partly accepting request
    proposer.propose(second, 8)
    proposer.record("a3", 1, 1)
    proposer.finish(second)
    assert proposer.priors.prior("key:a") == pytest.approx(1 / 3)
    assert proposer.draft_length("a2").rate == 0.0                 # running requests keep their own


# ------------------------------------------------------------------ the shortest match


def test_the_shortest_match_rises_after_rejections_until_the_first_accepted_draft() -> None:
    length = DraftLength(5, 1.0, min_match=2, max_match=4)
    matches = []
    for proposed, accepted in ((5, 0), (3, 0), (1, 0), (1, 1), (1, 0), (2, 0)):
        length.record(proposed, accepted)
        matches.append(length.min_match)
    assert matches == [3, 4, 4, 2, 2, 2]
    fixed = DraftLength(5, 1.0, min_match=3, max_match=3)
    fixed.record(5, 0)
    assert fixed.min_match == 3
    with pytest.raises(ValueError, match="rate"):
        DraftLength(5, 1.5)


@pytest.mark.parametrize("seed", range(4))
def test_the_index_and_the_history_draft_only_from_matches_at_least_the_shortest(seed: int) -> None:
    rng = random.Random(seed)
    tokens = [rng.randrange(3) for _ in range(40)]
    context = [rng.randrange(3) for _ in range(6)]
    index, store = NgramIndex(1, 4, tokens), HistoryStore(1, 4, 1000, 1000)
    store.record("t", tokens)
    for min_match in range(0, 6):
        least = max(1, min_match)
        assert index.propose(3, min_match) == brute_force_proposal(tokens, least, 4, 3)
        assert store.propose("t", context, 3, min_match) == brute_force([tokens], context, least, 4, 3)
    assert index.propose(3, 5) == [] and store.propose("t", context, 3, 5) == []


def test_a_rejected_short_match_makes_the_request_wait_for_a_longer_one() -> None:
    """An open question's waste: a 2-token match drafts, the model disagrees; the next 2-token
    match drafts nothing, a longer one does."""
    proposer = DraftProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2,
                                               prompt_lookup_max=4))
    request = make_request("o", [5, 1, 2, 7, 8, 6, 9, 1, 2], max_tokens=50)
    assert proposer.propose(request, 8) == [7, 8, 6]
    proposer.record("o", 3, 0)
    for token in (4, 3, 1, 2):                     # suffix (3, 1, 2): only (1, 2) occurred before
        request.append_output_token(token)
    assert proposer.propose(request, 8) == []
    for token in (7, 8, 6):                        # suffix (2, 7, 8, 6): occurred before
        request.append_output_token(token)
    assert proposer.propose(request, 8) == [9, 1]  # a 4-token match; the rate fell to 0.5
    proposer.record("o", 2, 2)
    for token in (9, 1, 4, 5, 1):                  # suffix (4, 5, 1): only (5, 1) occurred before
        request.append_output_token(token)
    assert proposer.propose(request, 8) == [2, 7]  # after an acceptance a 2-token match drafts again
