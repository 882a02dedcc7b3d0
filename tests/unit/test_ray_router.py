"""``KVAwareRequestRouter`` driven by Ray's own router machinery with stand-in replicas: KV events
fed to its index decide where a prompt goes, a session's holder comes first, a dead replica's
blocks leave the index, and requests without a prompt go by load."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray.serve")

from support.ray_routing import (  # noqa: E402
    DOCUMENT,
    StandInReplica,
    completion,
    envelope,
    make_router,
    ranked,
    store_prompt,
)


def test_a_prompt_goes_to_the_replica_whose_events_stored_its_prefix() -> None:
    async def run() -> None:
        replicas = [StandInReplica("a"), StandInReplica("b")]
        router = make_router(replicas)
        assert store_prompt(router, "b", DOCUMENT) > 4
        for question in ("Why?", "How long?", "Where do they end?"):
            assert (await ranked(router, replicas, envelope(completion(question))))[0] == "b"
        assert router.reasons == {"kv": 3}
        router.routing.close()

    asyncio.run(run())


def test_a_session_goes_to_its_holder_before_the_cached_prefix() -> None:
    async def run() -> None:
        replicas = [StandInReplica("a"), StandInReplica("b")]
        router = make_router(replicas)
        store_prompt(router, "b", DOCUMENT)
        assert (await ranked(router, replicas, envelope(completion("Q"), holder="a")))[0] == "a"
        # A holder that is not among the live replicas is ignored: the prefix decides.
        assert (await ranked(router, replicas, envelope(completion("Q"), holder="gone")))[0] == "b"
        router.routing.close()

    asyncio.run(run())


def test_a_dead_replica_leaves_the_index_and_routing_falls_back_to_load() -> None:
    async def run() -> None:
        replicas = [StandInReplica("a", running=3), StandInReplica("b"), StandInReplica("c", running=1)]
        router = make_router(replicas)
        store_prompt(router, "a", DOCUMENT)
        assert (await ranked(router, replicas, envelope(completion("Q"))))[0] == "a"
        router.on_replica_actor_died(replicas[0].replica_id)
        assert "a" not in router.routing.ingests
        live = replicas[1:]
        assert await ranked(router, live, envelope(completion("Q"))) == ["b", "c"]
        assert router.reasons["load"] == 1
        router.routing.close()

    asyncio.run(run())


def test_a_replica_scaled_away_leaves_the_index_and_its_sessions_go_to_a_survivor() -> None:
    async def run() -> None:
        replicas = [StandInReplica("a"), StandInReplica("b", running=2), StandInReplica("c")]
        router = make_router(replicas)
        store_prompt(router, "a", DOCUMENT)
        # Ray stops "a" (scale-down): the next replica list lacks it.
        router.update_replicas(replicas[1:])   # type: ignore[arg-type]
        assert "a" not in router.routing.ingests
        order = await ranked(router, replicas[1:], envelope(completion("Q"), holder="a"))
        assert order == ["c", "b"] and router.reasons == {"load": 1}
        router.routing.close()

    asyncio.run(run())


def test_requests_without_a_prompt_go_to_the_least_loaded_replica() -> None:
    async def run() -> None:
        replicas = [StandInReplica("a", running=4), StandInReplica("b", running=0)]
        router = make_router(replicas)
        assert (await ranked(router, replicas, envelope(method="GET", path="/v1/models")))[0] == "b"
        assert (await ranked(router, replicas, envelope({"model": "m", "prompt": 7})))[0] == "b"
        router.routing.close()

    asyncio.run(run())


def test_a_cache_keys_replica_comes_first_while_its_load_allows_and_a_prefix_outweighs_it() -> None:
    async def run() -> None:
        replicas = [StandInReplica("a"), StandInReplica("b"), StandInReplica("c")]
        router = make_router(replicas)
        keyed = envelope(completion("Q"), key_holder="b")
        assert [(await ranked(router, replicas, keyed))[0] for _ in range(3)] == ["b"] * 3
        assert router.reasons == {"cache_key": 3}
        store_prompt(router, "c", DOCUMENT)         # the index knows who holds the prompt's prefix
        assert (await ranked(router, replicas, envelope(completion("Q"), key_holder="b")))[0] == "c"
        router.routing.close()
        busy = [StandInReplica("a"), StandInReplica("b", running=6)]     # too busy: the key goes elsewhere
        router = make_router(busy)
        assert await ranked(router, busy, keyed) == ["a", "b"] and router.reasons == {"load": 1}
        router.routing.close()

    asyncio.run(run())


def test_the_envelope_names_the_session_a_request_continues() -> None:
    assert envelope(headers=(("x-session-id", "s1"),)).session_named(None) == "s1"
    assert envelope().session_named({"conversation_id": "c1"}) == "c1"
    assert envelope().session_named({"previous_response_id": "resp_1"}) == "resp_1"
    assert envelope(method="GET", path="/v1/context/s9").session_named(None) == "s9"
    assert envelope(path="/v1/context/s9/fork").session_named({}) == "s9"
    assert envelope(path="/v1/context/s9/other").session_named({}) is None
    assert envelope(headers=(("x-api-key", "k"),)).owner == envelope(headers=(("authorization", "Bearer k"),)).owner
    assert envelope(method="GET", path="/v1/responses/resp_2/input_items").session_named(None) == "resp_2"
    assert envelope().session_named({"prompt": "hi"}) is None


def test_the_envelope_shows_ray_s_own_routers_its_prompt_messages_or_input() -> None:
    assert envelope({"model": "m", "prompt": "Once upon"}).prompt == "Once upon"
    messages = [{"role": "user", "content": "Hi"}]
    assert envelope({"model": "m", "messages": messages}).prompt == messages
    assert envelope({"model": "m", "input": "And then?", "previous_response_id": "resp_1"}).prompt == "And then?"
    assert envelope(method="GET", path="/v1/models").prompt == "GET /v1/models"
    assert envelope({"model": "m", "prompt": 7}).prompt == "POST /v1/completions"


def test_a_messages_body_is_routed_by_the_chat_it_renders_to() -> None:
    body = {"model": "m", "max_tokens": 4, "system": "Be brief.", "messages": [{"role": "user", "content": "Hi"}]}
    prompt = envelope(body, path="/v1/messages").routing_prompt(body, salt_with_key=False)
    assert prompt is not None and [m["role"] for m in prompt.messages] == ["system", "user"]
    # The same body on chat completions is not a chat body (a system field, no system message).
    assert envelope(body, path="/v1/chat/completions").routing_prompt(body, False).messages[0]["role"] == "user"
