"""Forks, turn boundaries and the conversation knobs in the session layer (no model, no server):
a fork copies the parent's record up to a turn and pins the same blocks for itself, records keep
their turn boundaries across a reload (old records still read), ``turn_number`` is checked, and
``--max-active-conversations`` ends the least recently used idle conversation."""

from __future__ import annotations

import asyncio

import pytest
from support.sessions import BLOCK_BYTES, BLOCK_SIZE, CONFIG, Holder, hashes, registry

from kvhive.config import SessionConfig
from kvhive.server.errors import session_error
from kvhive.sessions.backends import FileBackend
from kvhive.sessions.registry import SessionInvalid, SessionLimit, SessionNotFound, SessionStale
from kvhive.sessions.service import SessionService
from kvhive.sessions.session import MAX_TURN_ENDS, Session


def service(holder: Holder, config: SessionConfig = CONFIG, **kwargs) -> SessionService:
    return SessionService(config, holder, block_bytes=BLOCK_BYTES, block_size=BLOCK_SIZE, **kwargs)


def blocks(prefix: str, n: int) -> list[bytes]:
    return [bytes.fromhex(h) for h in hashes(prefix, n)]


def three_turns(sessions: SessionService, owner: str | None = "k") -> Session:
    """A session whose turns ended holding 1, 2 and 3 full blocks (plus 5 tokens)."""
    turn = asyncio.run(sessions.open_turn(owner, "m", 4 * BLOCK_SIZE, new_ttl=60))
    turn.end(BLOCK_SIZE + 5, blocks("a", 1))
    for n in (2, 3):
        turn = asyncio.run(sessions.open_turn(owner, "m", 4 * BLOCK_SIZE, session_id=turn.session.session_id))
        turn.end(n * BLOCK_SIZE + 5, blocks("a", n))
    return turn.session


def test_a_session_records_where_each_turn_ended_and_a_rewrite_drops_the_old_ones():
    session = Session("s", None, "m", 60, 0.0, 60.0)
    session.record_turn(20, hashes("a", 1))
    session.record_turn(40, hashes("a", 2))
    assert (session.num_turns, session.turn_ends) == (2, [20, 40])
    assert [session.tokens_after(t) for t in (1, 2, None)] == [20, 40, 40]
    session.record_turn(35, hashes("b", 2))                  # another history: turns 1-2 are gone
    assert (session.num_turns, session.turn_ends) == (3, [35])
    with pytest.raises(SessionInvalid, match="no longer records where turn 1 ended"):
        session.tokens_after(1)
    for bad in (0, 4, -1):
        with pytest.raises(SessionInvalid, match="'turn' must be between 1 and 3"):
            session.tokens_after(bad)
    for n in range(MAX_TURN_ENDS + 5):
        session.record_turn(40 + n, hashes("b", 2))
    assert len(session.turn_ends) == MAX_TURN_ENDS and session.tokens_after(session.num_turns - 1) == 40 + MAX_TURN_ENDS + 3


def test_records_keep_their_turns_and_old_records_read_as_one_turn(tmp_path):
    session = Session("s", "o", "m", 60, 1.0, 61.0)
    session.record_turn(20, hashes("a", 1))
    session.record_turn(40, hashes("a", 2))
    again = Session.from_json(session.to_json())
    assert (again.num_turns, again.turn_ends, again.conversation) == (2, [20, 40], False)
    old = {k: v for k, v in session.to_json().items() if k not in ("num_turns", "turn_ends", "conversation")}
    assert (Session.from_json(old).num_turns, Session.from_json(old).turn_ends) == (1, [40])
    assert Session.from_json({**old, "num_tokens": 0, "block_hashes": []}).num_turns == 0


def test_a_fork_copies_the_parent_up_to_a_turn_and_pins_those_blocks_for_itself():
    holder = Holder()
    sessions = service(holder)
    parent = three_turns(sessions)
    child, shared = asyncio.run(sessions.fork("k", parent.session_id, turn=2))
    assert child.session_id != parent.session_id and child.owner == "k" and child.model == "m"
    assert (child.num_tokens, child.block_hashes) == (2 * BLOCK_SIZE + 5, parent.block_hashes[:2])
    assert (child.num_turns, child.turn_ends, child.ttl_s, child.busy) == (2, parent.turn_ends[:2], 60, False)
    assert holder.held[-1] == (child.engine_id, blocks("a", 2))
    assert holder.forked == [(parent.engine_id, child.engine_id, 2 * BLOCK_SIZE + 5)]
    assert shared == 2 * BLOCK_SIZE
    latest, _ = asyncio.run(sessions.fork("k", parent.session_id, ttl_s=30))
    assert (latest.num_tokens, latest.num_turns, latest.ttl_s) == (parent.num_tokens, 3, 30)
    # The child's turns leave the parent as it was.
    turn = asyncio.run(sessions.open_turn("k", "m", 100, session_id=child.session_id))
    turn.end(5 * BLOCK_SIZE, blocks("a", 2) + blocks("c", 3))
    assert (parent.num_turns, parent.num_tokens, parent.block_hashes) == (3, 3 * BLOCK_SIZE + 5, hashes("a", 3))
    assert child.num_turns == 3 and child.turn_ends == [BLOCK_SIZE + 5, 2 * BLOCK_SIZE + 5, 5 * BLOCK_SIZE]


def test_a_fork_of_another_keys_or_an_unknown_session_or_turn_creates_nothing():
    holder = Holder()
    sessions = service(holder)
    parent = three_turns(sessions)
    before = len(sessions.registry.live_sessions())
    for owner, sid, turn, kind in (("other", parent.session_id, None, SessionNotFound),
                                   ("k", "sess-unknown", None, SessionNotFound),
                                   ("k", parent.session_id, 4, SessionInvalid)):
        with pytest.raises(kind):
            asyncio.run(sessions.fork(owner, sid, turn=turn))
    assert len(sessions.registry.live_sessions()) == before and holder.forked == []


def test_a_fork_counts_in_the_keys_limits():
    holder = Holder()
    sessions = service(holder, SessionConfig(max_ttl_s=3600, max_pinned_gb=None, max_sessions_per_key=1))
    parent = three_turns(sessions)
    with pytest.raises(SessionLimit, match="max-sessions-per-key"):
        asyncio.run(sessions.fork("k", parent.session_id))
    # A per-key KV limit of 4 blocks: the parent holds 3 blocks and 5 tokens; a fork of as many is over.
    limited = service(Holder(), SessionConfig(max_ttl_s=3600, max_pinned_gb=4 * BLOCK_BYTES / 2**30))
    parent = three_turns(limited)
    with pytest.raises(SessionLimit, match="max-pinned-gb"):
        asyncio.run(limited.fork("k", parent.session_id))
    assert len(limited.registry.live_sessions()) == 1


def test_a_fork_survives_a_reload(tmp_path):
    holder = Holder()
    sessions = service(holder, backend=FileBackend(str(tmp_path)))
    parent = three_turns(sessions)
    child, _ = asyncio.run(sessions.fork("k", parent.session_id, turn=1))
    pins = []
    reloaded = registry(FileBackend(str(tmp_path)), pins=lambda s: pins.append(s.engine_id))
    again = reloaded.get(child.session_id, "k")
    assert (again.num_tokens, again.block_hashes, again.num_turns) == (child.num_tokens, child.block_hashes, 1)
    assert child.engine_id in pins


def test_turn_number_must_be_the_sessions_next_turn():
    sessions = service(Holder())
    parent = three_turns(sessions)
    for stale, code in ((3, "stale_turn_number"), (1, "stale_turn_number"), (5, "turn_number_ahead")):
        with pytest.raises(SessionStale, match=f"'turn_number' is {stale}") as caught:
            asyncio.run(sessions.open_turn("k", "m", 10, session_id=parent.session_id, turn_number=stale))
        assert caught.value.code == code and session_error(caught.value).status_code == 409
    assert not parent.busy
    turn = asyncio.run(sessions.open_turn("k", "m", 10, session_id=parent.session_id, turn_number=4))
    assert parent.busy and turn.number
    with pytest.raises(SessionStale):
        asyncio.run(sessions.open_turn("k", "m", 10, conversation_id="new", turn_number=2))
    assert asyncio.run(sessions.open_turn("k", "m", 10, conversation_id="new", turn_number=1)).created


def test_max_active_conversations_ends_the_least_recently_used_idle_one():
    holder = Holder()
    now = [1000.0]
    sessions = service(holder, SessionConfig(max_ttl_s=3600, max_pinned_gb=None, max_active_conversations=2),
                       clock=lambda: now[0])
    for name in ("a", "b"):
        asyncio.run(sessions.open_turn("k", "m", 10, conversation_id=name)).end(20, blocks(name, 1))
        now[0] += 1
    asyncio.run(sessions.open_turn("k", "m", 10, conversation_id="a")).end(30, blocks("a", 1))   # a: newer
    context = asyncio.run(sessions.open_turn("k", "m", 10, new_ttl=60))   # a /v1/context session: not counted
    context.end(20, blocks("e", 1))
    asyncio.run(sessions.open_turn("k", "m", 10, conversation_id="c")).end(20, blocks("c", 1))
    live = {s.session_id for s in sessions.registry.live_sessions()}
    assert {"a", "c"} <= live and "b" not in live and context.session.session_id in live
    assert holder.released == ["k/b"]
    # All live conversations busy: the new one is refused, nothing ended.
    busy = [asyncio.run(sessions.open_turn("k", "m", 10, conversation_id=n)) for n in ("a", "c")]
    with pytest.raises(SessionLimit, match="max-active-conversations") as caught:
        asyncio.run(sessions.open_turn("k", "m", 10, conversation_id="d"))
    assert session_error(caught.value).status_code == 429 and holder.released == ["k/b"]
    for turn in busy:
        turn.end()
    # "b" comes back as a new conversation (its blocks were left to the prefix cache).
    assert asyncio.run(sessions.open_turn("k", "m", 10, conversation_id="b")).created


def test_the_conversation_flags_show_in_help_and_reach_the_config(capsys):
    import argparse

    from kvhive.cli import main
    from kvhive.serve_args import add_serve_args, build_engine_config

    with pytest.MonkeyPatch.context() as patch, pytest.raises(SystemExit):
        patch.setenv("COLUMNS", "1000")
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--enable-conversation-caching, --no-enable-conversation-caching" in text
    assert "--max-active-conversations N" in text
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    default = build_engine_config(parser.parse_args([])).sessions
    assert (default.enable_conversation_caching, default.max_active_conversations) == (True, None)
    chosen = build_engine_config(parser.parse_args(["--no-enable-conversation-caching",
                                                    "--max-active-conversations", "3"])).sessions
    assert (chosen.enable_conversation_caching, chosen.max_active_conversations) == (False, 3)
    with pytest.raises(ValueError, match="--max-active-conversations must be at least 1"):
        build_engine_config(parser.parse_args(["--max-active-conversations", "0"]))


def test_stored_responses_chains_are_pinned_within_the_keeper_tier_and_the_key_limit():
    from kvhive.sessions.chain_pins import chain_pin_id
    from kvhive.sessions.limits import KeeperTier

    holder = Holder()
    keeper = KeeperTier("disk", int(10 * BLOCK_BYTES / 0.9) + 1, "--disk-cache-gb 1")   # room for 10 blocks
    sessions = service(holder, SessionConfig(max_ttl_s=3600, max_pinned_gb=6 * BLOCK_BYTES / 2**30), keeper=keeper)
    parent = three_turns(sessions)                       # the session pins 3 blocks
    assert sessions.pin_chain("k", "resp_a", hashes("a", 3) + hashes("b", 2))      # 2 blocks beyond it
    assert holder.held[-1] == (chain_pin_id("k", "resp_a"), blocks("a", 3) + blocks("b", 2))
    assert sessions.registry.pinned_block_bytes() == 5 * BLOCK_BYTES
    # The key may pin 6 blocks' worth: its session's 53 tokens plus 2 extra blocks fit, 3 more do not.
    assert not sessions.pin_chain("k", "resp_c", hashes("a", 3) + hashes("c", 3))
    assert sessions.pin_chain("other", "resp_o", hashes("d", 5))                   # another key
    assert not sessions.pin_chain("other", "resp_p", hashes("e", 1) + hashes("d", 5))   # the tier is full
    assert sessions.registry.pinned_block_bytes() == 10 * BLOCK_BYTES
    assert sessions.unpin_chains("k", ["resp_a", "resp_never"]) == 1
    assert holder.held[-1] == (chain_pin_id("k", "resp_a"), [])
    assert sessions.registry.pinned_block_bytes() == 8 * BLOCK_BYTES and parent.num_turns == 3


def test_a_new_conversation_refused_by_another_limit_evicts_nothing():
    holder = Holder()
    sessions = service(holder, SessionConfig(max_ttl_s=3600, max_pinned_gb=None, max_active_conversations=1,
                                             max_sessions_per_key=1))
    asyncio.run(sessions.open_turn("k", "m", 10, conversation_id="a")).end(20, blocks("a", 1))
    with pytest.raises(SessionLimit, match="max-sessions-per-key"):
        asyncio.run(sessions.open_turn("k", "m", 10, conversation_id="b"))
    assert [s.session_id for s in sessions.registry.live_sessions()] == ["a"] and holder.released == []
    asyncio.run(sessions.open_turn("other", "m", 10, conversation_id="b")).end(20, blocks("b", 1))
    assert [s.session_id for s in sessions.registry.live_sessions()] == ["b"] and holder.released == ["k/a"]


def test_a_fork_of_a_busy_session_holds_its_last_finished_turn():
    holder = Holder()
    sessions = service(holder)
    parent = three_turns(sessions)
    running = asyncio.run(sessions.open_turn("k", "m", 4 * BLOCK_SIZE, session_id=parent.session_id))
    child, _ = asyncio.run(sessions.fork("k", parent.session_id))
    assert parent.busy and not child.busy
    assert (child.num_turns, child.num_tokens) == (3, 3 * BLOCK_SIZE + 5)
    running.end(4 * BLOCK_SIZE, blocks("a", 4))
    assert (child.num_turns, parent.num_turns) == (3, 4)


def test_a_stored_responses_chain_is_kept_in_its_record_and_old_records_have_none():
    from kvhive.sessions.response_store import StoredResponse

    stored = StoredResponse("o", {"id": "resp_x", "model": "m"}, [], hashes("a", 2))
    assert StoredResponse.from_json(stored.to_json()).chain == hashes("a", 2)
    bare = StoredResponse("o", {"id": "resp_y", "model": "m"}, [])
    assert "chain" not in bare.to_json() and StoredResponse.from_json(bare.to_json()).chain == []
