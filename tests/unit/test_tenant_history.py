"""The "history" drafter without a model: the store's lookups against a brute-force search over the
sequences it keeps, its token caps per tenant and in all (oldest evicted first, the index shrinking
with them), tenants kept apart, the proposer's order (own tokens first, then history), and the
config keys with their exit 2."""

from __future__ import annotations

import random

import pytest
from support.scheduler_parts import make_request

from kvhive.cli import parse_args, serve
from kvhive.core.speculative_config import SpeculativeConfig, parse_speculative_config
from kvhive.engine.speculative.draft_proposals import DraftProposer
from kvhive.engine.speculative.tenant_history import HistoryStore, TenantHistory


def brute_force(sequences: list[list[int]], context: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """What followed the latest occurrence (latest sequence, then latest position) of the longest
    suffix of ``context`` in the kept sequences, found by scanning them all."""
    for n in range(min(max_n, len(context)), min_n - 1, -1):
        suffix = context[len(context) - n:]
        for seq in reversed(sequences):
            starts = [s for s in range(len(seq) - n) if seq[s:s + n] == suffix]
            if starts:
                return seq[max(starts) + n:max(starts) + n + k]
    return []


@pytest.mark.parametrize("seed", range(8))
def test_lookups_find_what_a_scan_of_the_kept_sequences_finds(seed: int) -> None:
    rng = random.Random(seed)
    min_n, max_n = rng.choice([(1, 1), (1, 3), (2, 4), (3, 3)])
    cap = rng.choice([15, 40, 200])
    store = HistoryStore(min_n, max_n, max_tokens=cap, tenant_max_tokens=cap)
    kept: list[list[int]] = []
    for _ in range(60):
        seq = [rng.randrange(4) for _ in range(rng.randint(1, 12))]
        store.record("t", seq)
        if len(seq) > min_n:
            kept.append(seq)
            while sum(map(len, kept)) > cap:
                kept.pop(0)                       # oldest first
        for _ in range(3):
            context = [rng.randrange(4) for _ in range(rng.randint(1, 6))]
            k = rng.randint(1, 6)
            assert store.propose("t", context, k) == brute_force(kept, context, min_n, max_n, k)
        stats = store.stats()
        assert stats.num_tokens == sum(map(len, kept)) <= cap and stats.num_sequences == len(kept)
        # At most one index entry per kept token and n-gram length.
        assert stats.num_index_entries <= stats.num_tokens * (max_n - min_n + 1)


def test_evicting_every_sequence_empties_the_index_and_the_array() -> None:
    history = TenantHistory(1, 3)
    rng = random.Random(0)
    for _ in range(50):
        history.add([rng.randrange(50) for _ in range(30)])
        if history.num_sequences > 3:
            history.evict_oldest()
        assert len(history._tokens) <= 2 * 4 * 31 + 31     # compacted as it goes
    while history.num_sequences:
        history.evict_oldest()
    assert history.num_index_entries == 0 and history.num_tokens == 0
    assert history.propose([1, 2], 4) == []


def test_the_caps_evict_the_tenants_oldest_then_anyones_oldest() -> None:
    store = HistoryStore(2, 2, max_tokens=30, tenant_max_tokens=20)
    store.record("a", [1, 2, 3] * 3)              # 9 tokens
    store.record("a", [4, 5, 6] * 3)              # 18
    store.record("a", [7, 8, 9] * 3)              # 27 > 20: a's first goes
    assert store.propose("a", [1, 2], 2) == [] and store.propose("a", [5, 6], 2) == [4, 5]
    store.record("b", [10, 11, 12] * 4)           # 30 in all: fits exactly
    assert store.stats().num_tokens == 30 and store.stats().num_tenants == 2
    store.record(None, [20, 21, 22])              # 33 > 30: the oldest of all (a's [4, 5, 6]) goes
    assert store.propose("a", [5, 6], 2) == [] and store.propose("a", [8, 9], 5) == [7, 8, 9]
    store.record("b", list(range(100, 150)))      # longer than a tenant's cap: its last 20 tokens
    assert store.propose("b", [131, 132], 3) == [133, 134, 135] and store.propose("b", [129, 130], 1) == []
    # b's cap evicted its own first sequence, then the cap of all a's last one (the oldest of all).
    assert store.stats().num_tokens == 23 and store.propose("b", [10, 11], 1) == []
    assert store.propose("a", [8, 9], 1) == [] and store.propose(None, [20, 21], 1) == [22]
    store.record("c", [1])                        # too short to draft from: not kept
    assert store.stats().num_tenants == 2 and store.propose("c", [1], 1) == []
    with pytest.raises(ValueError):
        HistoryStore(1, 2, max_tokens=10, tenant_max_tokens=11)


def test_one_tenant_never_drafts_from_anothers_text() -> None:
    store = HistoryStore(2, 3, max_tokens=1000, tenant_max_tokens=500)
    store.record("key:a", [5, 6, 7, 8, 9])
    store.record("key:b", [5, 6, 1, 2, 3])
    store.record(None, [5, 6, 40, 41])
    assert store.propose("key:a", [5, 6], 3) == [7, 8, 9]
    assert store.propose("key:b", [5, 6], 3) == [1, 2, 3]
    assert store.propose(None, [5, 6], 3) == [40, 41]
    assert store.propose("key:c", [5, 6], 3) == [] and store.propose("key:a", [6, 40], 3) == []


def test_the_proposer_drafts_from_the_request_first_then_its_tenants_history() -> None:
    config = SpeculativeConfig(num_speculative_tokens=3, method="history", prompt_lookup_min=2,
                               prompt_lookup_max=2, history_max_tokens=100, history_tenant_max_tokens=50)
    proposer = DraftProposer(config)
    first = make_request("a1", [1, 2, 3, 4, 5, 6], max_tokens=20)
    first.cache_salt = "key:a"
    proposer.propose(first, 3)
    proposer.finish(first)
    assert proposer.history_stats().num_tokens == 6 and proposer.draft_length("a1") is None
    again = make_request("a2", [9, 1, 2], max_tokens=20)
    again.cache_salt = "key:a"
    assert proposer.propose(again, 3) == [3, 4, 5]        # its own tokens give none: the history's
    proposer.record("a2", 3, 2)
    quoting = make_request("a3", [3, 4, 8, 3, 4], max_tokens=20)
    quoting.cache_salt = "key:a"
    assert proposer.propose(quoting, 3) == [8, 3, 4]      # its own tokens first
    proposer.record("a3", 3, 3)
    other = make_request("b1", [9, 1, 2], max_tokens=20)
    other.cache_salt = "key:b"
    assert proposer.propose(other, 3) == []
    stats = proposer.stats()
    assert (stats.num_draft_tokens, stats.num_accepted_tokens) == (6, 5)
    assert (stats.num_history_draft_tokens, stats.num_history_accepted_tokens) == (3, 2)
    ngram = DraftProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=2))
    ngram.finish(first)
    assert ngram.history_stats() is None and ngram.propose(again, 3) == []


def test_the_history_keys_and_their_defaults() -> None:
    config = parse_speculative_config('{"method": "history", "num_speculative_tokens": 4}')
    assert (config.method, config.history_max_tokens, config.history_tenant_max_tokens) == (
        "history", 1_000_000, 250_000)
    config = parse_speculative_config('{"method": "history", "num_speculative_tokens": 4, "history_max_tokens": 1000}')
    assert (config.history_max_tokens, config.history_tenant_max_tokens) == (1000, 1000)
    config = parse_speculative_config('{"method": "history", "num_speculative_tokens": 2, '
                                      '"history_max_tokens": 5000, "history_tenant_max_tokens": 100}')
    assert (config.history_max_tokens, config.history_tenant_max_tokens) == (5000, 100)
    assert parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 2}').method == "ngram"


@pytest.mark.parametrize(("text", "named"), [
    ('{"method": "history", "num_speculative_tokens": 2, "history_max_tokens": 0}',
     "history_max_tokens must be an integer in 1..100000000"),
    ('{"method": "history", "num_speculative_tokens": 2, "history_max_tokens": "big"}', "history_max_tokens must be"),
    ('{"method": "history", "num_speculative_tokens": 2, "history_tenant_max_tokens": 100000001}',
     "history_tenant_max_tokens must be an integer"),
    ('{"method": "history", "num_speculative_tokens": 2, "history_max_tokens": 10, "history_tenant_max_tokens": 20}',
     "history_tenant_max_tokens (20) is above history_max_tokens (10)"),
    ('{"num_speculative_tokens": 2, "history_max_tokens": 10}', 'history_max_tokens needs method "history"'),
    ('{"method": "suffix", "num_speculative_tokens": 2}', "unknown method 'suffix' (known: ngram, history)"),
])
def test_bad_history_keys_exit_2_naming_the_key(text: str, named: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="--speculative-config"):
        parse_speculative_config(text)
    assert serve(parse_args(["serve", "--speculative-config", text])) == 2
    err = capsys.readouterr().err
    assert "--speculative-config" in err and named in err
