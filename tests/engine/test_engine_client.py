"""EngineClient over a running AsyncEngine (tiny random model in process): engine-state reads run on
the loop thread, a session's blocks are held in and released from the store tiers, and calls fail
once the loop has stopped."""

from __future__ import annotations

import asyncio
import threading

import pytest
from support.engines import GREEDY, make_engine, make_engine_with_cpu_tier

from kvhive.core.tokenizer import Tokenizer
from kvhive.engine.async_engine import AsyncEngine
from kvhive.engine.client import EngineClient


def test_calls_run_on_the_loop_thread_and_fail_once_it_stops(tokenizer: Tokenizer) -> None:
    async_engine = AsyncEngine(make_engine(tokenizer))
    async_engine.start()
    try:
        assert asyncio.run(async_engine.call(lambda _: threading.current_thread().name)) == "kvhive-engine"

        def broken(_):
            raise KeyError("nope")

        with pytest.raises(KeyError):
            asyncio.run(async_engine.call(broken))
    finally:
        async_engine.shutdown()
    with pytest.raises(RuntimeError, match="stopped"):
        asyncio.run(async_engine.call(lambda _: None))


def test_a_session_is_held_in_the_store_tiers_and_released(tokenizer: Tokenizer) -> None:
    engine = make_engine_with_cpu_tier(tokenizer, 64)
    async_engine = AsyncEngine(engine)
    async_engine.start()
    client = EngineClient(async_engine)
    try:
        assert client.keeper_budget() is not None and client.keeper_budget().name == "cpu"

        async def one_turn() -> tuple[bytes, ...]:
            hashes: tuple[bytes, ...] = ()
            async for out in client.generate("r1", list(range(10, 30)), GREEDY, session_id="s"):
                hashes = out.session_block_hashes or hashes
            return hashes

        hashes = asyncio.run(one_turn())
        assert len(hashes) >= 5
        blocks = asyncio.run(client.session_blocks_by_tier(hashes))
        assert blocks["device"] == len(hashes) and set(blocks) == {"device", "cpu"}
        client.hold_session("s", hashes)
        assert len(engine.store.pinned_keys()) == len(hashes)
        assert 0 <= client.pinned_blocks_by_tier()["cpu"] <= len(hashes)   # saves land on a writer thread
        client.release_session("s")
        assert engine.store.pinned_keys() == [] and client.pinned_blocks_by_tier() == {"cpu": 0}
        assert asyncio.run(client.session_blocks_by_tier([])) == {"device": 0}
    finally:
        async_engine.shutdown()


def test_check_structured_compiles_off_the_loop_and_refuses_bad_specs(tokenizer: Tokenizer) -> None:
    from kvhive.core.structured_spec import StructuredSpec
    from kvhive.engine.client import StructuredOutputError

    engine = make_engine(tokenizer)
    async_engine = AsyncEngine(engine)
    async_engine.start()
    client = EngineClient(async_engine)
    try:
        good = StructuredSpec("choice", choices=("yes", "no"))
        asyncio.run(client.check_structured(good))
        assert engine.grammars.misses == 1
        with pytest.raises(StructuredOutputError) as info:
            asyncio.run(client.check_structured(StructuredSpec("regex", pattern="(", source="guided_regex")))
        assert info.value.param == "guided_regex"
        engine.grammars.time_limit_s = 0.0          # every new compile is now over the limit
        with pytest.raises(StructuredOutputError, match=r"compiling the json_schema constraint t"):
            asyncio.run(client.check_structured(StructuredSpec("json_schema", schema='{"type": "integer"}')))
        asyncio.run(client.check_structured(good))  # compiled before: from the cache
    finally:
        async_engine.shutdown()
