"""Tier events: blocks entering and leaving the CPU and disk tiers, told to a sink, published over ZMQ
and weighted by the gateway's scorer by the tier that holds them."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from support.tier_sinks import RecordingSink

from kvhive.kv.event_publisher import KVEventPublisher
from kvhive.kv.tier_events import TierEventForwarder, tier_medium
from kvhive.routing.block_keys import BlockKeyMapper
from kvhive.routing.index import InMemoryIndex
from kvhive.routing.ingest import ReplicaIngest
from kvhive.routing.scorer import LongestPrefixMatch, TierWeights
from kvhive.store.disk import DiskStore
from kvhive.store.key import KeySpace, StoreKey
from kvhive.store.memory import MemoryStore
from kvhive.store.tiered import Tier, TierChange, TieredStore

SPACE = KeySpace("test-model", 1, "float32", 16)
BLOCK = 1000


def digest(i: int) -> bytes:
    return i.to_bytes(16, "big")


def key(i: int) -> StoreKey:
    return SPACE.key(digest(i))


def payload(i: int) -> bytes:
    return bytes([i % 256]) * BLOCK


def production_tiers(path: str, cpu_blocks: int, disk_bytes: int = 10_000_000) -> TieredStore:
    """cpu (memory) over a write-through disk, as ``DurableState`` builds them."""
    return TieredStore([Tier("cpu", MemoryStore(cpu_blocks * BLOCK)),
                        Tier("disk", DiskStore(path, disk_bytes, segment_bytes=100_000), write_through=True)])


def test_puts_evictions_and_promotions_are_told_in_order(tmp_path) -> None:
    store, sink = production_tiers(str(tmp_path), cpu_blocks=2), RecordingSink()
    store.send_events_to(sink, SPACE.prefix)
    assert sink.calls == []                                   # an empty disk: nothing to announce
    store.put(key(1), payload(1))
    assert sink.calls[-1] == [TierChange("cpu", True, (digest(1),)), TierChange("disk", True, (digest(1),))]
    store.put(key(2), payload(2))
    store.put(key(3), payload(3))                             # the CPU tier holds two: 1 leaves it
    assert sink.calls[-1] == [TierChange("cpu", True, (digest(3),)), TierChange("cpu", False, (digest(1),)),
                              TierChange("disk", True, (digest(3),))]
    assert store.get(key(1)) is not None                      # a disk hit promoted into the CPU tier
    assert sink.calls[-1] == [TierChange("cpu", True, (digest(1),)), TierChange("cpu", False, (digest(2),))]
    store.delete(key(3))
    assert sink.calls[-1] == [TierChange("cpu", False, (digest(3),)), TierChange("disk", False, (digest(3),))]
    store.close()


def test_the_event_view_matches_what_the_tiers_hold_as_disk_segments_are_dropped(tmp_path) -> None:
    store, sink = production_tiers(str(tmp_path), cpu_blocks=3, disk_bytes=8 * 1100), RecordingSink()
    store.send_events_to(sink, SPACE.prefix)
    for i in range(30):
        store.put(key(i), payload(i))
        if i % 3 == 0:
            store.get(key(i // 2))
    cpu, disk = (tier.store for tier in store.tiers)
    view = sink.view()
    assert view["cpu"] == {digest(i) for i in range(30) if cpu.contains([key(i)])[0]}
    assert view["disk"] == set(disk.held_hashes(SPACE.prefix))
    assert any(not c.stored and c.tier == "disk" for changes in sink.calls for c in changes)   # drops told
    store.close()


def test_a_restarted_replica_announces_the_disk_blocks_it_kept(tmp_path) -> None:
    first = production_tiers(str(tmp_path), cpu_blocks=4)
    for i in range(3):
        first.put(key(i), payload(i))
    first.put(KeySpace("other-model", 1, "float32", 16).key(digest(9)), payload(9))
    first.close()
    again, sink = production_tiers(str(tmp_path), cpu_blocks=4), RecordingSink()
    again.send_events_to(sink, SPACE.prefix)
    (announced,), = sink.calls
    assert announced.tier == "disk" and announced.stored
    assert sorted(announced.block_hashes) == [digest(i) for i in range(3)]   # this key space only
    again.close()


def test_tier_names_map_to_media() -> None:
    assert [tier_medium(t) for t in ("cpu", "disk", "redis", "nvme")] == ["CPU", "DISK", "REMOTE", "REMOTE"]


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture()
def gateway_view(tmp_path):
    """A replica's publisher and tiers, and a gateway's ingest and index subscribed over real ZMQ."""
    publisher = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    index = InMemoryIndex()
    ingest = ReplicaIngest("replica-1", index, BlockKeyMapper(False, 16, b"\0" * 16), publisher.endpoint,
                           publisher.replay_endpoint)
    store = production_tiers(str(tmp_path), cpu_blocks=4)
    store.send_events_to(TierEventForwarder(publisher, 16), SPACE.prefix)
    ingest.start()
    try:
        deadline = time.monotonic() + 5
        while ingest.stats.batches == 0:                   # PUB drops until the subscription arrives
            assert time.monotonic() < deadline, "gateway never subscribed"
            publisher.publish_cleared()
            time.sleep(0.02)
        yield publisher, store, index
    finally:
        ingest.close()
        publisher.close()
        store.close()


def test_gateway_weights_blocks_by_the_tier_holding_them(gateway_view) -> None:
    publisher, store, index = gateway_view
    chain = [digest(i) for i in range(4)]
    weights = TierWeights()                                 # GPU 1.0, CPU 0.8, DISK 0.5

    def score() -> float:
        return LongestPrefixMatch().score(index.lookup(chain), weights).get("replica-1", 0.0)

    publisher.publish_stored(chain, None, list(range(64)), 16)
    wait_until(lambda: score() == pytest.approx(4.0), "device blocks")
    for i in range(4):                                      # the connector saves them: CPU and disk
        store.put(key(i), payload(i))
    publisher.publish_removed(chain)                        # the device pool evicts them
    wait_until(lambda: score() == pytest.approx(4 * 0.8), "CPU blocks")
    for i in range(10, 13):                                 # other blocks push 0..2 out of the CPU tier
        store.put(key(i), payload(i))
    wait_until(lambda: score() == pytest.approx(3 * 0.5 + 0.8), "disk blocks")
    assert index.lookup(chain) == [{"replica-1": "DISK"}] * 3 + [{"replica-1": "CPU"}]


@pytest.mark.parametrize("foreign", [True, False], ids=["vllm-replica", "kvhive-replica-int64"])
def test_int_hashes_and_location_only_tier_events_map_through_the_device_event(foreign: bool) -> None:
    """A vLLM replica (or a kvhive one with hash_format int64) names blocks by 64-bit ints: the
    gateway recomputes its keys from the device event's tokens, and a later tier event without
    tokens finds them through the same ints."""
    from kvhive.core.blocks import hash_blocks, root_hash
    from kvhive.core.kv_events import BlockRemoved, BlockStored

    root = root_hash(0, "test-fingerprint")
    tokens = list(range(500, 548))
    ours = hash_blocks(tokens, 16, root)
    mapper, index = BlockKeyMapper(foreign, 16, root), InMemoryIndex()

    def apply(event) -> None:
        if isinstance(event, BlockStored):
            index.add(mapper.stored(event), "r", event.medium)
        else:
            index.remove(mapper.removed(event), "r", event.medium)

    apply(BlockStored([11, 12, 13], None, tokens, 16, None, "GPU"))
    apply(BlockStored([11, 12], None, [], 16, None, "CPU"))          # offloaded: no tokens
    apply(BlockStored([99], None, [], 16, None, "CPU"))              # never seen: skipped
    apply(BlockRemoved([11, 12, 13], "GPU"))
    assert index.lookup(ours) == [{"r": "CPU"}] * 2
    assert mapper.num_unmapped == 1
    apply(BlockRemoved([11], "CPU"))
    assert index.lookup(ours) == []


def test_a_replica_that_restarts_and_sends_more_while_unheard_is_forgotten_and_replayed() -> None:
    """A restarted replica's stream may pass the old one's sequence before the gateway's SUB socket
    reconnects (its AllBlocksCleared at 0 unheard): the reconnection itself starts the gateway over
    from the new replay buffer, so the old life's blocks go and the new life's are all there."""
    from support.servers import free_port

    events, replay = free_port(), free_port()
    first = KVEventPublisher(f"tcp://*:{events}", f"tcp://127.0.0.1:{replay}")     # "*": bound
    index = InMemoryIndex()
    ingest = ReplicaIngest("r", index, BlockKeyMapper(False, 16, b"\0" * 16), f"tcp://127.0.0.1:{events}",
                           f"tcp://127.0.0.1:{replay}")
    ingest.start()
    try:
        first.publish_cleared()
        wait_until(lambda: (first.publish_stored([digest(1)], None, [], 16) or True) and
                   index.lookup([digest(1)]) != [], "the first life's block")
        first.close()
        second = KVEventPublisher(f"tcp://*:{events}", f"tcp://127.0.0.1:{replay}")
        try:
            second.publish_cleared()
            second.publish_stored([digest(2)], None, [], 16)
            for _ in range(50):                                # more batches than the first life sent
                second.publish_removed([digest(99)])
            wait_until(lambda: index.lookup([digest(2)]) != [], "the second life's block")
            wait_until(lambda: index.lookup([digest(1)]) == [], "the first life's block to go")
            second.publish_stored([digest(3)], None, [], 16)
            wait_until(lambda: index.lookup([digest(3)]) != [], "the stream after the restart")
        finally:
            second.close()
    finally:
        ingest.close()
