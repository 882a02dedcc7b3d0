"""Scoring: llm-d's three KV scorers, tier weights, and the pick that combines cache with load."""

from __future__ import annotations

import pytest

from kvhive.routing.scorer import (
    SCORERS,
    CoverageBasedMatching,
    HighestBlockHit,
    LoadStats,
    LongestPrefixMatch,
    RoutingWeights,
    TierWeights,
    pick_replica,
)

FLAT = TierWeights(1.0, 1.0, 1.0, 1.0)
# Blocks 0..4 of a prompt: a holds 0,1,2 on the device; b holds 0 on CPU and 2,3,4 on the device;
# c holds only block 4.
HITS = [{"a": "GPU", "b": "CPU"}, {"a": "GPU"}, {"a": "GPU", "b": "GPU"}, {"b": "GPU"},
        {"b": "GPU", "c": "DISK"}]


def test_longest_prefix_match_counts_the_unbroken_run_from_block_zero() -> None:
    assert LongestPrefixMatch().score(HITS, FLAT) == {"a": 3.0, "b": 1.0}
    assert LongestPrefixMatch().score(HITS, TierWeights()) == {"a": 3.0, "b": 0.8}
    assert LongestPrefixMatch().score([], FLAT) == {}


def test_highest_block_hit_is_the_position_of_the_last_hit() -> None:
    assert HighestBlockHit().score(HITS, FLAT) == {"a": 3.0, "b": 5.0, "c": 5.0}
    assert HighestBlockHit().score(HITS, TierWeights()) == {"a": 3.0, "b": 5.0, "c": 2.5}


def test_coverage_based_matching_counts_every_hit() -> None:
    assert CoverageBasedMatching().score(HITS, FLAT) == {"a": 3.0, "b": 4.0, "c": 1.0}
    weighted = CoverageBasedMatching().score(HITS, TierWeights())
    assert weighted == pytest.approx({"a": 3.0, "b": 3.8, "c": 0.5})


def test_scorers_are_registered_by_name() -> None:
    assert {name: cls.__name__ for name, cls in SCORERS.items()} == {
        "longest_prefix": "LongestPrefixMatch", "highest_block": "HighestBlockHit",
        "coverage": "CoverageBasedMatching"}


def test_tier_weights_order_and_validation() -> None:
    tiers = TierWeights()
    assert tiers.of("GPU") > tiers.of("CPU") > tiers.of("DISK") > tiers.of("REMOTE") > 0
    assert tiers.of("unknown") == tiers.remote
    with pytest.raises(ValueError):
        TierWeights(gpu=1.5)
    with pytest.raises(ValueError):
        RoutingWeights(load=-1)


def test_pick_prefers_the_cached_replica_over_a_slightly_busier_one() -> None:
    loads = {"a": LoadStats(running=2), "b": LoadStats()}
    pick = pick_replica(["a", "b"], {"a": 8.0}, 10, loads, RoutingWeights())
    # a: 1.0*0.8 - 0.5*2/3 = 0.467 ; b: 0
    assert pick.replica == "a" and pick.ranking == ["a", "b"]
    assert pick.kv_blocks == 8.0
    assert pick.scores["a"] == pytest.approx(0.8 - 0.5 * 2 / 3)


def test_pick_leaves_a_small_hit_on_a_loaded_replica() -> None:
    loads = {"a": LoadStats(running=4, waiting=3), "b": LoadStats()}
    pick = pick_replica(["a", "b"], {"a": 1.0}, 10, loads, RoutingWeights())
    assert pick.replica == "b"
    assert pick.kv_blocks == 0.0


def test_pick_weights_waiting_and_kv_usage() -> None:
    loads = {"a": LoadStats(running=1, waiting=1), "b": LoadStats(running=2)}
    assert pick_replica(["a", "b"], {}, 0, loads, RoutingWeights(waiting_factor=2.0)).replica == "b"
    assert pick_replica(["a", "b"], {}, 0, loads, RoutingWeights(waiting_factor=0.5)).replica == "a"
    usage = {"a": LoadStats(kv_usage=0.9), "b": LoadStats(kv_usage=0.1)}
    assert pick_replica(["a", "b"], {}, 0, usage, RoutingWeights()).replica == "b"
    only_cache = RoutingWeights(load=0, kv_usage=0)
    assert pick_replica(["a", "b"], {"a": 1.0}, 10, loads, only_cache).replica == "a"


def test_a_small_common_prefix_does_not_draw_new_prompts_to_its_holder() -> None:
    # 2 of 63 blocks (a chat template's system prompt) cached on a, which fills more of its pool.
    usage = {"a": LoadStats(kv_usage=0.3), "b": LoadStats(kv_usage=0.1)}
    assert pick_replica(["a", "b"], {"a": 2.0}, 63, usage, RoutingWeights()).replica == "b"
    assert pick_replica(["a", "b"], {"a": 2.0}, 63, usage, RoutingWeights(min_share=0)).replica == "a"
    # From min_share up the cached share counts again.
    assert pick_replica(["a", "b"], {"a": 7.0}, 63, usage, RoutingWeights()).replica == "a"
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="min_share"):
            RoutingWeights(min_share=bad)


def test_ties_are_broken_round_robin() -> None:
    picks = [pick_replica(["a", "b", "c"], {}, 0, {}, RoutingWeights(), turn).replica for turn in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]
    with pytest.raises(ValueError):
        pick_replica([], {}, 0, {}, RoutingWeights())


def test_a_cache_keys_replica_gets_its_bonus_until_its_queue_outweighs_it() -> None:
    weights = RoutingWeights()
    names = ["a", "b", "c"]

    def pick(queue_b: float, kv: dict[str, float] | None = None, w: RoutingWeights = weights) -> tuple[str, str]:
        chosen = pick_replica(names, kv or {}, 10, {"b": LoadStats(running=queue_b)}, w, key_holder="b")
        return chosen.replica, chosen.reason

    assert pick(0) == ("b", "cache_key") and pick(3) == ("b", "cache_key")
    assert pick(5)[0] != "b"                                     # 0.4 < 0.5 * 5 / 6: the key overflows
    assert pick(0, {"c": 5.0}) == ("c", "kv")                    # half the prompt cached beats the key
    assert pick(0, w=RoutingWeights(cache_key=0.0))[1] == "load"
    assert pick_replica(names, {}, 10, {}, weights, key_holder="gone").reason == "load"
