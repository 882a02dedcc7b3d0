"""Prompt-cache pins without a model or a server: one pin per breakpoint, owned by the API key,
counted in the session budgets, refreshed on each read, expired by the sweep, persisted by the
file backend, and Anthropic's counters."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
from support.responses import Clock
from support.sessions import BLOCK_BYTES, BLOCK_SIZE, CONFIG, Holder

from kvhive.config import SessionConfig
from kvhive.core.retention import PINNED_PRIORITY, RetentionRange, RetentionSpec
from kvhive.sessions.backends import FileBackend
from kvhive.sessions.errors import SessionInvalid, SessionLimit, SessionNotFound
from kvhive.sessions.limits import KeeperTier
from kvhive.sessions.prefix_pins import Breakpoint, CacheUsage, PinTurn, pin_ids, split_usage
from kvhive.sessions.service import SessionService

PROMPT = list(range(1000, 1000 + 5 * BLOCK_SIZE + 7))      # 5 full blocks and 7 tokens


def service(holder: Holder | None = None, config: SessionConfig = CONFIG, **kwargs) -> SessionService:
    return SessionService(config, holder or Holder(), block_bytes=BLOCK_BYTES, block_size=BLOCK_SIZE, **kwargs)


def block_hashes(prompt: list[int]) -> list[bytes]:
    """Stand-ins for the engine's full-block hashes of ``prompt`` (distinct per prefix)."""
    return [hashlib.blake2b(repr(prompt[:(i + 1) * BLOCK_SIZE]).encode(), digest_size=16).digest()
            for i in range(len(prompt) // BLOCK_SIZE)]


def open_pins(sessions: SessionService, owner: str | None, breakpoints: list[Breakpoint],
              prompt: list[int] = PROMPT, **kwargs) -> PinTurn:
    return asyncio.run(sessions.prefix_pins.open(owner, "m", prompt, breakpoints, **kwargs))


def request(sessions: SessionService, owner: str | None, breakpoints: list[Breakpoint], cached_tokens: int,
            prompt: list[int] = PROMPT) -> CacheUsage:
    """One request carrying ``breakpoints`` that the engine served ``cached_tokens`` of from cache."""
    turn = open_pins(sessions, owner, breakpoints, prompt)
    return turn.end(block_hashes(prompt), cached_tokens)


def test_a_first_request_creates_its_pins_and_a_repeat_reads_them() -> None:
    holder = Holder()
    sessions = service(holder)
    points = [Breakpoint(2 * BLOCK_SIZE, 300), Breakpoint(4 * BLOCK_SIZE + 3, 300)]
    first = open_pins(sessions, "k", points)
    assert first.retention == RetentionSpec((RetentionRange(0, 2 * BLOCK_SIZE, PINNED_PRIORITY, 300.0),
                                             RetentionRange(0, 4 * BLOCK_SIZE + 3, PINNED_PRIORITY, 300.0)))
    usage = first.end(block_hashes(PROMPT), cached_tokens=0)
    assert usage == CacheUsage(0, 4 * BLOCK_SIZE + 3, len(PROMPT) - 4 * BLOCK_SIZE - 3)
    pins = sessions.list("k")
    assert [(p.kind, p.num_tokens, len(p.block_hashes), p.busy) for p in pins] == [
        ("pin", 2 * BLOCK_SIZE, 2, False), ("pin", 4 * BLOCK_SIZE + 3, 4, False)]
    assert sorted(len(h) for _, h in holder.held) == [2, 4]          # store-tier pins of full blocks
    # The repeat: the engine served 4 full blocks from cache; the read stops at the furthest pin.
    again = request(sessions, "k", points, cached_tokens=4 * BLOCK_SIZE)
    assert again == CacheUsage(4 * BLOCK_SIZE, 3, len(PROMPT) - 4 * BLOCK_SIZE - 3)
    assert sum(again.__dict__.values()) == len(PROMPT)
    assert len(sessions.list("k")) == 2 and len(holder.held) == 2      # the same two pins, not pinned again


def test_the_read_is_at_most_what_the_engine_served_from_cache_and_no_further_than_the_pins() -> None:
    sessions = service()
    request(sessions, "k", [Breakpoint(2 * BLOCK_SIZE, 300)], cached_tokens=0)
    # A longer breakpoint: only the pinned prefix reads, even when the engine cached more.
    usage = request(sessions, "k", [Breakpoint(2 * BLOCK_SIZE, 300), Breakpoint(5 * BLOCK_SIZE, 300)],
                    cached_tokens=5 * BLOCK_SIZE)
    assert usage == CacheUsage(2 * BLOCK_SIZE, 3 * BLOCK_SIZE, 7)
    # The pins live, but the engine had lost the blocks: it reads what it served.
    usage = request(sessions, "k", [Breakpoint(5 * BLOCK_SIZE, 300)], cached_tokens=BLOCK_SIZE)
    assert usage == CacheUsage(BLOCK_SIZE, 4 * BLOCK_SIZE, 7)


def test_without_breakpoints_every_token_is_input_and_nothing_is_pinned() -> None:
    holder = Holder()
    sessions = service(holder)
    turn = open_pins(sessions, "k", [])
    assert turn.retention is None and turn.merged_retention(None) is None
    assert turn.end(block_hashes(PROMPT), 50) == CacheUsage(0, 0, len(PROMPT))
    assert sessions.list("k") == [] and holder.held == []


def test_another_key_never_reads_a_pin_and_the_cache_salt_names_another_pin() -> None:
    sessions = service()
    points = [Breakpoint(3 * BLOCK_SIZE, 300)]
    request(sessions, "alice", points, cached_tokens=0)
    assert request(sessions, "bob", points, cached_tokens=3 * BLOCK_SIZE).cache_read_input_tokens == 0
    assert len(sessions.list("alice")) == len(sessions.list("bob")) == 1
    salted = pin_ids("m", "s", PROMPT, points)
    assert salted != pin_ids("m", None, PROMPT, points)
    assert pin_ids("m", None, PROMPT, points) == [sessions.list("alice")[0].session_id]


def test_a_read_refreshes_the_ttl_and_an_expired_pin_is_created_again() -> None:
    clock, holder = Clock(), Holder()
    sessions = service(holder, clock=clock)
    points = [Breakpoint(3 * BLOCK_SIZE, 300)]
    request(sessions, "k", points, cached_tokens=0)
    pin = sessions.list("k")[0]
    clock.now += 250
    assert request(sessions, "k", points, cached_tokens=3 * BLOCK_SIZE).cache_read_input_tokens == 3 * BLOCK_SIZE
    assert pin.expires == clock.now + 300                         # refreshed by the read
    clock.now += 250                                              # 500 s after the write: still live
    assert sessions.sweep() == 0 and sessions.list("k") == [pin]
    clock.now += 301
    assert sessions.sweep() == 1 and holder.released == [pin.engine_id]
    # The prefix cache may still hold the blocks: the request counts them as created all the same.
    usage = request(sessions, "k", points, cached_tokens=3 * BLOCK_SIZE)
    assert usage == CacheUsage(0, 3 * BLOCK_SIZE, len(PROMPT) - 3 * BLOCK_SIZE)


def test_a_shorter_ttl_never_cuts_a_longer_pin_short() -> None:
    clock = Clock()
    sessions = service(clock=clock)
    request(sessions, "k", [Breakpoint(BLOCK_SIZE, 3600)], cached_tokens=0)
    request(sessions, "k", [Breakpoint(BLOCK_SIZE, 300)], cached_tokens=BLOCK_SIZE)
    pin = sessions.list("k")[0]
    assert (pin.ttl_s, pin.expires) == (3600, clock.now + 3600)


def test_bad_breakpoints_are_refused_before_anything_changes() -> None:
    sessions = service(config=SessionConfig(max_ttl_s=600, max_pinned_gb=None))
    cases = [[Breakpoint(BLOCK_SIZE, 601)], [Breakpoint(BLOCK_SIZE, 0)], [Breakpoint(len(PROMPT) + 1, 60)],
             [Breakpoint(0, 60)], [Breakpoint(i + 1, 60) for i in range(5)]]
    for points in cases:
        with pytest.raises(SessionInvalid) as exc:
            open_pins(sessions, "k", points, param="prompt_cache_retention")
        assert exc.value.param == "prompt_cache_retention"
    assert sessions.list("k") == []


def test_pins_count_in_the_per_key_session_budget() -> None:
    sessions = service(config=SessionConfig(max_ttl_s=3600, max_pinned_gb=None, max_sessions_per_key=2))
    asyncio.run(sessions.open_turn("k", "m", 10, new_ttl=60)).end(10, [], 0)
    with pytest.raises(SessionLimit):             # two new pins, one slot left: neither is made
        open_pins(sessions, "k", [Breakpoint(BLOCK_SIZE, 60), Breakpoint(2 * BLOCK_SIZE, 60)])
    assert len(sessions.list("k")) == 1
    request(sessions, "k", [Breakpoint(BLOCK_SIZE, 60)], cached_tokens=0)
    assert len(sessions.list("k")) == 2
    # Reading a pin that exists needs no new slot.
    assert request(sessions, "k", [Breakpoint(BLOCK_SIZE, 60)], BLOCK_SIZE).cache_read_input_tokens == BLOCK_SIZE
    assert len(sessions.list("other")) == 0 and request(sessions, "other", [Breakpoint(BLOCK_SIZE, 60)], 0)


def test_pins_count_in_the_per_key_kv_budget() -> None:
    tokens_allowed = 4 * BLOCK_SIZE
    config = SessionConfig(max_ttl_s=3600, max_pinned_gb=tokens_allowed * BLOCK_BYTES / BLOCK_SIZE / 2**30)
    sessions = service(config=config)
    request(sessions, "k", [Breakpoint(3 * BLOCK_SIZE, 60)], cached_tokens=0)
    with pytest.raises(SessionLimit):
        open_pins(sessions, "k", [Breakpoint(2 * BLOCK_SIZE, 60)])
    assert len(sessions.list("k")) == 1


def test_a_request_that_never_computed_its_prompt_drops_the_pins_it_created() -> None:
    holder = Holder()
    sessions = service(holder)
    request(sessions, "k", [Breakpoint(BLOCK_SIZE, 60)], cached_tokens=0)
    turn = open_pins(sessions, "k", [Breakpoint(BLOCK_SIZE, 60), Breakpoint(3 * BLOCK_SIZE, 60)])
    assert [p.busy for p in sessions.list("k")] == [False, True]
    assert turn.end(None, 0) == CacheUsage(0, 3 * BLOCK_SIZE, len(PROMPT) - 3 * BLOCK_SIZE)
    assert [p.num_tokens for p in sessions.list("k")] == [BLOCK_SIZE]      # the older pin stays
    assert turn.end(block_hashes(PROMPT), 99) == CacheUsage(0, 3 * BLOCK_SIZE, len(PROMPT) - 3 * BLOCK_SIZE)


def test_a_pin_in_flight_is_not_read_by_a_concurrent_request() -> None:
    sessions = service()
    points = [Breakpoint(2 * BLOCK_SIZE, 60)]
    first = open_pins(sessions, "k", points)
    second = open_pins(sessions, "k", points)
    assert len(sessions.list("k")) == 1
    assert second.end(block_hashes(PROMPT), 2 * BLOCK_SIZE).cache_read_input_tokens == 0
    assert first.end(block_hashes(PROMPT), 0).cache_creation_input_tokens == 2 * BLOCK_SIZE
    assert [p.busy for p in sessions.list("k")] == [False]


def test_a_pin_cannot_be_run_in_as_a_session() -> None:
    sessions = service()
    request(sessions, "k", [Breakpoint(BLOCK_SIZE, 60)], cached_tokens=0)
    pin = sessions.list("k")[0]
    with pytest.raises(SessionNotFound):
        asyncio.run(sessions.open_turn("k", "m", 10, session_id=pin.session_id))


def test_pins_survive_a_restart_with_the_file_backend(tmp_path) -> None:
    clock, holder = Clock(), Holder()
    sessions = service(holder, backend=FileBackend(str(tmp_path)), clock=clock)
    points = [Breakpoint(2 * BLOCK_SIZE, 600), Breakpoint(5 * BLOCK_SIZE, 600)]
    request(sessions, "k", points, cached_tokens=0)
    before = sorted((p.num_tokens, p.session_id, p.kind, p.block_hashes, p.expires) for p in sessions.list("k"))
    reloaded_holder = Holder()
    reloaded = service(reloaded_holder, backend=FileBackend(str(tmp_path)), clock=clock)
    after = sorted((p.num_tokens, p.session_id, p.kind, p.block_hashes, p.expires) for p in reloaded.list("k"))
    assert after == before and len(after) == 2
    assert sorted(len(h) for _, h in reloaded_holder.held) == [2, 5]      # pinned again in the store tiers
    usage = request(reloaded, "k", points, cached_tokens=5 * BLOCK_SIZE)
    assert usage == CacheUsage(5 * BLOCK_SIZE, 0, 7)
    clock.now += 601                                                    # and they expire as before
    assert reloaded.sweep() == 2 and reloaded.list("k") == []


def test_the_client_retention_is_merged_with_the_pins() -> None:
    sessions = service()
    turn = open_pins(sessions, "k", [Breakpoint(BLOCK_SIZE, 60)])
    client = RetentionSpec((RetentionRange(BLOCK_SIZE, 2 * BLOCK_SIZE, 90, None),), decode_priority=10)
    merged = turn.merged_retention(client)
    assert merged is not None and merged.decode_priority == 10
    assert merged.ranges == (RetentionRange(BLOCK_SIZE, 2 * BLOCK_SIZE, 90, None),
                             RetentionRange(0, BLOCK_SIZE, PINNED_PRIORITY, 60.0))


def test_the_counters_sum_to_the_prompt() -> None:
    for cached in (0, 5, 40, 100, 200):
        usage = split_usage(120, last_breakpoint=100, read_limit=60, cached_tokens=cached)
        assert sum(usage.__dict__.values()) == 120
        assert usage.cache_read_input_tokens == min(60, cached)


def test_an_in_memory_pin_is_a_device_priority_only(tmp_path) -> None:
    holder = Holder()
    keeper = KeeperTier("disk", 3 * BLOCK_BYTES, "--disk-cache-gb")      # room for 2 pinned blocks
    sessions = service(holder, backend=FileBackend(str(tmp_path)), keeper=keeper)
    memory = [Breakpoint(5 * BLOCK_SIZE, 300, in_memory=True)]
    turn = open_pins(sessions, "k", memory)                       # 5 blocks: no room asked of the keeper
    assert turn.retention == RetentionSpec((RetentionRange(0, 5 * BLOCK_SIZE, PINNED_PRIORITY, 300.0),))
    turn.end(block_hashes(PROMPT), 0)
    assert request(sessions, "k", memory, 5 * BLOCK_SIZE).cache_read_input_tokens == 5 * BLOCK_SIZE
    [pin] = sessions.list("k")
    assert pin.in_memory and len(pin.block_hashes) == 5 and holder.held == []
    assert sessions.registry.pinned_block_bytes() == 0
    # The same prefix pinned durably is another pin, which the keeper's room bounds.
    with pytest.raises(SessionLimit):
        open_pins(sessions, "k", [Breakpoint(5 * BLOCK_SIZE, 300)])
    request(sessions, "k", [Breakpoint(2 * BLOCK_SIZE, 300)], cached_tokens=2 * BLOCK_SIZE)
    assert sorted(len(h) for _, h in holder.held) == [2]
    reloaded = service(Holder(), backend=FileBackend(str(tmp_path)), keeper=keeper)
    assert [(p.num_tokens, p.in_memory) for p in reloaded.list("k")] == [(2 * BLOCK_SIZE, False)]


def test_prompt_cache_retention_maps_onto_one_pin_of_the_whole_prompt() -> None:
    from kvhive.server.prompt_cache import retention_breakpoints

    assert retention_breakpoints(None, 100, 3600) == []
    assert retention_breakpoints("in_memory", 100, 3600) == [Breakpoint(100, 300, in_memory=True)]
    assert retention_breakpoints("in_memory", 100, 60) == [Breakpoint(100, 60, in_memory=True)]
    assert retention_breakpoints("24h", 100, 3600) == [Breakpoint(100, 86400)]      # the pins refuse it


def test_a_pin_whose_request_never_ended_expires_all_the_same() -> None:
    clock, holder = Clock(), Holder()
    sessions = service(holder, clock=clock)
    open_pins(sessions, "k", [Breakpoint(BLOCK_SIZE, 60)])
    [pin] = sessions.list("k")
    assert pin.busy and sessions.sweep() == 0
    clock.now += 61
    assert sessions.sweep() == 1 and sessions.list("k") == [] and holder.released == [pin.engine_id]


def test_a_conversation_reads_the_pin_its_previous_turn_made_at_an_earlier_position() -> None:
    sessions = service()
    first_turn = PROMPT[:3 * BLOCK_SIZE + 2]
    request(sessions, "k", [Breakpoint(len(first_turn), 300)], cached_tokens=0, prompt=first_turn)
    # The next turn moves its breakpoint to its own end: the previous turn's prefix is read.
    usage = request(sessions, "k", [Breakpoint(len(PROMPT), 300)], cached_tokens=3 * BLOCK_SIZE)
    assert usage == CacheUsage(3 * BLOCK_SIZE, len(PROMPT) - 3 * BLOCK_SIZE, 0)
    # Another key's pin, or a pin of another prefix, is never read.
    assert request(sessions, "other", [Breakpoint(len(PROMPT), 300)], cached_tokens=3 * BLOCK_SIZE) == CacheUsage(
        0, len(PROMPT), 0)
    changed = [7, *PROMPT[1:]]
    assert request(sessions, "k", [Breakpoint(len(changed), 300)], cached_tokens=0, prompt=changed) == CacheUsage(
        0, len(changed), 0)
