"""SessionService without a model or a server: turns open and end once, pins and releases go to
the engine's holder, expiry releases, the keeper tier's budget rule, and the error kinds' statuses."""

from __future__ import annotations

import asyncio

import pytest
from support.sessions import BLOCK_BYTES, BLOCK_SIZE, CONFIG, Holder, hashes

from kvhive.config import SessionConfig, StoreConfig
from kvhive.engine.stats import TierBudget
from kvhive.server.errors import session_error
from kvhive.sessions.backends import FileBackend
from kvhive.sessions.registry import SessionBusy, SessionInvalid, SessionLimit, SessionNotFound
from kvhive.sessions.service import NO_TURN, SessionService, keeper_tier


class Clock:
    """A settable unix clock."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def service(holder: Holder, config: SessionConfig = CONFIG, **kwargs) -> SessionService:
    return SessionService(config, holder, block_bytes=BLOCK_BYTES, block_size=BLOCK_SIZE, **kwargs)


def blocks(prefix: str, n: int) -> list[bytes]:
    return [bytes.fromhex(h) for h in hashes(prefix, n)]


def test_a_turn_ends_once_and_pins_what_the_session_holds() -> None:
    holder = Holder()
    sessions = service(holder)
    turn = asyncio.run(sessions.open_turn("k", "m", 100, new_ttl=60))
    session = turn.session
    assert session is not None and session.busy and turn.engine_id == session.engine_id
    held = blocks("a", 2)
    turn.end(2 * BLOCK_SIZE + 5, held, cached_tokens=7)
    assert not session.busy and session.num_tokens == 2 * BLOCK_SIZE + 5
    assert session.block_hashes == [h.hex() for h in held]
    assert holder.held == [(session.engine_id, held)]
    turn.end()                                              # the stream's own end: nothing more
    assert holder.held == [(session.engine_id, held)] and sessions.stats().hit_tokens_total == 7
    # A turn stopped early keeps what the session held, slides the expiry and pins nothing new.
    again = asyncio.run(sessions.open_turn("k", "m", 10, session_id=session.session_id))
    again.end()
    assert not session.busy and len(holder.held) == 1 and session.block_hashes == [h.hex() for h in held]


def test_a_request_outside_any_session_runs_in_no_turn() -> None:
    holder = Holder()
    turn = asyncio.run(service(holder).open_turn("k", "m", 10))
    assert turn is NO_TURN and turn.engine_id is None and not turn.end_session
    turn.end(5, blocks("a", 1))
    assert holder.held == [] and holder.released == []


def test_an_unknown_conversation_starts_a_session_and_an_unknown_session_id_is_not_found() -> None:
    sessions = service(Holder(), SessionConfig(default_ttl_s=30, max_ttl_s=60))
    turn = asyncio.run(sessions.open_turn("k", "m", 10, conversation_id="conv-1"))
    assert turn.session is not None and (turn.session.session_id, turn.session.ttl_s) == ("conv-1", 30)
    with pytest.raises(SessionNotFound):
        asyncio.run(sessions.open_turn("k", "m", 10, session_id="sess-unknown"))
    with pytest.raises(SessionNotFound):                   # another key's conversation is not found
        asyncio.run(sessions.open_turn("other", "m", 10, session_id="conv-1"))


def test_a_busy_session_is_refused_unless_its_turn_ends_while_the_request_waits() -> None:
    sessions = service(Holder(), busy_wait_s=0.0)
    first = asyncio.run(sessions.open_turn("k", "m", 10, new_ttl=60))
    assert first.session is not None
    with pytest.raises(SessionBusy):
        asyncio.run(sessions.open_turn("k", "m", 10, session_id=first.session.session_id))
    assert first.session.busy and first.session.turn == 1          # nothing changed

    waiting = service(Holder(), busy_wait_s=60.0)
    running = asyncio.run(waiting.open_turn("k", "m", 10, new_ttl=60))
    assert running.session is not None

    async def next_turn_while_the_first_ends():
        task = asyncio.create_task(waiting.open_turn("k", "m", 10, session_id=running.session.session_id))
        await asyncio.sleep(0)
        running.end(BLOCK_SIZE, blocks("a", 1))
        return await task

    second = asyncio.run(next_turn_while_the_first_ends())
    assert second.session is running.session and second.number == 2 and second.session.busy


def test_an_older_turn_ending_late_leaves_the_running_turn_alone() -> None:
    sessions = service(Holder())
    first = asyncio.run(sessions.open_turn("k", "m", 10, new_ttl=60))
    first.end(BLOCK_SIZE, blocks("a", 1))
    second = asyncio.run(sessions.open_turn("k", "m", 10, session_id=first.session.session_id))
    first.end(2 * BLOCK_SIZE, blocks("b", 2))
    assert second.session.busy and second.session.block_hashes == hashes("a", 1)


def test_ending_the_conversation_deletes_the_session_and_releases_its_blocks() -> None:
    holder = Holder()
    sessions = service(holder)
    turn = asyncio.run(sessions.open_turn("k", "m", 10, conversation_id="c", end_session=True))
    turn.end(BLOCK_SIZE, blocks("a", 1))
    assert holder.released == [turn.engine_id] and holder.held == []
    with pytest.raises(SessionNotFound):
        asyncio.run(sessions.find("c", "k"))


def test_the_sweep_releases_expired_sessions_only() -> None:
    holder, clock = Holder(), Clock()
    sessions = service(holder, clock=clock)
    short = asyncio.run(sessions.open_turn("k", "m", 10, new_ttl=10))
    long = asyncio.run(sessions.open_turn("k", "m", 10, new_ttl=100))
    busy = asyncio.run(sessions.open_turn("k", "m", 10, new_ttl=10))
    short.end(BLOCK_SIZE, blocks("a", 1))
    long.end(BLOCK_SIZE, blocks("b", 1))
    clock.now += 50
    assert sessions.sweep() == 1                            # a busy session never expires under its turn
    assert holder.released == [short.engine_id]
    assert [s.session_id for s in sessions.list("k")] == [long.session.session_id, busy.session.session_id]


def test_sessions_loaded_from_the_backend_are_held_through_the_holder(tmp_path) -> None:
    first = service(Holder(), backend=FileBackend(str(tmp_path)))
    turn = asyncio.run(first.open_turn("k", "m", 10, new_ttl=600))
    turn.end(BLOCK_SIZE, blocks("a", 1))
    holder = Holder()
    service(holder, backend=FileBackend(str(tmp_path)))
    assert holder.held == [(turn.engine_id, blocks("a", 1))]


def test_the_keeper_tier_budget_rule_names_the_flag_that_sets_it() -> None:
    store = StoreConfig(cpu_offload_gb=2)
    assert keeper_tier(None, store) is None
    keeper = keeper_tier(TierBudget("cpu", 2 * 2**30), store)
    assert keeper is not None and (keeper.name, keeper.budget_bytes, keeper.option) == ("cpu", 2 * 2**30,
                                                                                      "--cpu-offload-gb 2")
    sessions = service(Holder(), keeper=keeper_tier(TierBudget("cpu", 4 * BLOCK_BYTES), store))
    with pytest.raises(SessionLimit) as full:
        asyncio.run(sessions.open_turn("k", "m", 10 * BLOCK_SIZE, new_ttl=60))
    assert full.value.code == "session_tier_full"


@pytest.mark.parametrize(("error", "status", "error_type"), [
    (SessionInvalid("bad", "invalid_session_id", "x-session-id"), 400, "invalid_request_error"),
    (SessionNotFound("gone", "session_not_found", "x-session-id"), 404, "invalid_request_error"),
    (SessionBusy("busy", "session_busy"), 409, "invalid_request_error"),
    (SessionLimit("full", "session_tier_full"), 429, "rate_limit_error"),
])
def test_the_server_maps_each_error_kind_to_its_status(error, status, error_type) -> None:
    api_error = session_error(error)
    assert api_error.status_code == status
    assert api_error.body() == {"error": {"message": error.message, "type": error_type, "param": error.param,
                                          "code": error.code}}
