"""The gateway's routing of the cache-control dialects against tiny in-process replicas: a
``prompt_cache_key`` keeps its replica per API key while load allows (a longer one than the bound
is a 400 and reaches no replica), ``/v1/messages`` is routed with Anthropic's error shape and
``x-api-key`` as the caller's key, and a fork goes to its parent's holder and the child follows it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from support.upstream_servers import OK, answers, gateway_for, served

from kvhive.core.anthropic_errors import as_anthropic_error
from kvhive.core.anthropic_messages import messages_chat, render_chat
from kvhive.core.blocks import hash_blocks, root_hash
from kvhive.core.request_fields import MAX_PROMPT_CACHE_KEY_CHARS
from kvhive.core.tenancy import key_owner
from kvhive.gateway.app import create_gateway_app
from kvhive.gateway.gateway import REASON_HEADER, REPLICA_HEADER
from kvhive.gateway.gateway_config import GatewayConfig, ReplicaSpec
from kvhive.routing.dialects import cut_stream_events, is_anthropic
from kvhive.routing.scorer import LoadStats, RoutingWeights

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4}
MESSAGES = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "Hello there"}]}


def json_answer(status: int, body: dict[str, Any], **headers: str) -> bytes:
    """A whole HTTP/1.1 answer with a JSON body."""
    raw = json.dumps(body).encode()
    extra = "".join(f"{k.replace('_', '-')}: {v}\r\n" for k, v in headers.items())
    return (f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {len(raw)}\r\n"
            f"{extra}\r\n").encode() + raw


def counted(part: bytes, log: list[str], name: str) -> Any:
    """``answers(part)`` that appends ``name`` to ``log`` for each request it reads."""
    inner = answers(part)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        log.append(name)
        await inner(reader, writer)
    return handle


async def gateway_client(urls: list[str], tokenizer: Any, **config: Any) -> tuple[httpx.AsyncClient, Any]:
    """An HTTP client of a gateway app over ``urls`` (every replica healthy), and its Gateway."""
    app = create_gateway_app(GatewayConfig(tuple(ReplicaSpec(u) for u in urls), **config), tokenizer)
    for replica in app.state.gateway.replicas.replicas:
        replica.healthy = True
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")
    return client, app.state.gateway


def test_a_cache_key_keeps_its_replica_while_its_load_allows() -> None:
    async def go(urls: list[str]) -> None:
        gateway = gateway_for(urls)
        gateway.policy = "kv"
        gateway.cache_keys.remember("owner-a", "k1", urls[1])

        async def first(key: str | None, owner: str = "owner-a") -> tuple[str, str]:
            ranked, reason = await gateway.choose(None, None, owner, cache_key=key)
            return ranked[0].name, reason

        assert [await first("k1") for _ in range(3)] == [(urls[1], "cache_key")] * 3
        gateway.replicas.replicas[1].load = LoadStats(running=3)     # busy, still its key's replica
        assert await first("k1") == (urls[1], "cache_key")
        gateway.replicas.replicas[1].load = LoadStats(running=6)     # too busy: the key overflows
        assert {name for name, _ in [await first("k1") for _ in range(4)]} == {urls[0], urls[2]}
        gateway.replicas.replicas[1].load = LoadStats()
        # Another API key's same key, or no key: ranked by load alone, in turn.
        others = [await first("k1", "owner-b") for _ in range(3)] + [await first(None) for _ in range(3)]
        assert {reason for _, reason in others} == {"load"} and {n for n, _ in others} == set(urls)
        gateway.weights = RoutingWeights(cache_key=0.0)               # --cache-key-weight 0
        assert {reason for _, reason in [await first("k1") for _ in range(3)]} == {"load"}

    served(None, None, None)(go)


def test_the_replica_that_answered_a_cache_key_gets_its_next_requests(tokenizer: Any) -> None:
    async def go(urls: list[str]) -> None:
        client, gateway = await gateway_client(urls, tokenizer)
        async with client:
            body = {**CHAT, "prompt_cache_key": "agent-7"}
            routed = [await client.post("/v1/chat/completions", json=body,
                                        headers={"authorization": "Bearer key-a"}) for _ in range(4)]
            assert {r.status_code for r in routed} == {200}
            holders = [r.headers[REPLICA_HEADER] for r in routed]
            assert len(set(holders)) == 1
            assert [r.headers[REASON_HEADER] for r in routed[1:]] == ["cache_key"] * 3
            # The same key sent with x-api-key is the same caller's; another API key is not steered.
            same = await client.post("/v1/responses", json={"model": "m", "input": "x", "prompt_cache_key": "agent-7"},
                                     headers={"x-api-key": "key-a"})
            assert same.headers[REPLICA_HEADER] == holders[0]
            assert gateway.cache_keys.get(key_owner("Bearer key-b"), "agent-7") is None
            theirs = [await client.post("/v1/chat/completions", json=body, headers={"authorization": "Bearer key-b"})
                      for _ in range(2)]
            assert theirs[0].headers[REASON_HEADER] == "load"

    served(answers(OK, close=False), answers(OK, close=False))(go)


def test_a_cache_key_over_the_bound_is_refused_before_any_replica_sees_it(tokenizer: Any) -> None:
    log: list[str] = []

    async def go(urls: list[str]) -> None:
        client, gateway = await gateway_client(urls, tokenizer)
        async with client:
            for path, body in (("/v1/chat/completions", CHAT), ("/v1/responses", {"model": "m", "input": "x"}),
                               ("/v1/completions", {"model": "m", "prompt": "x"})):
                refused = await client.post(path, json={**body, "prompt_cache_key": "k" * 10_240})
                error = refused.json()["error"]
                assert refused.status_code == 400 and error["param"] == "prompt_cache_key"
                assert error["type"] == "invalid_request_error" and "1024" in error["message"]
            assert log == [] and len(gateway.cache_keys) == 0
            fits = await client.post("/v1/chat/completions",
                                     json={**CHAT, "prompt_cache_key": "k" * MAX_PROMPT_CACHE_KEY_CHARS})
            assert fits.status_code == 200 and log == ["r0"] and len(gateway.cache_keys) == 1

    served(counted(OK, log, "r0"))(go)


def test_messages_are_routed_and_the_gateways_own_errors_are_anthropic_shaped(tokenizer: Any) -> None:
    openai_400 = json_answer(400, {"error": {"message": "bad field", "type": "invalid_request_error",
                                             "param": None, "code": None}})

    async def go(urls: list[str]) -> None:
        ok, openai_shaped, garbage = urls
        client, gateway = await gateway_client([ok], tokenizer, max_request_bytes=4096)
        async with client:
            for path in ("/v1/messages", "/v1/messages/count_tokens"):
                answer = await client.post(path, json=MESSAGES, headers={"x-api-key": "key-a"})
                assert answer.status_code == 200 and answer.headers[REPLICA_HEADER] == ok
            too_big = await client.post("/v1/messages", content=b"x" * 5000)
            assert too_big.status_code == 413
            assert too_big.json() == {"type": "error", "error": {
                "type": "request_too_large", "message": too_big.json()["error"]["message"]}}
            for replica in gateway.replicas.replicas:
                replica.healthy = False
            none = await client.post("/v1/messages", json=MESSAGES)
            assert none.status_code == 503 and none.json()["error"]["type"] == "overloaded_error"
            chat_none = await client.post("/v1/chat/completions", json=CHAT)
            assert chat_none.json()["error"]["code"] == "no_replica"         # OpenAI's elsewhere
        client, _ = await gateway_client([openai_shaped], tokenizer)
        async with client:
            reshaped = await client.post("/v1/messages", json=MESSAGES)
            assert reshaped.status_code == 400
            assert reshaped.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                                  "message": "bad field"}}
        client, _ = await gateway_client([garbage], tokenizer)
        async with client:
            broken = await client.post("/v1/messages", json=MESSAGES)
            assert broken.status_code == 502 and broken.json()["type"] == "error"
            assert broken.json()["error"]["type"] == "api_error"

    served(answers(OK, close=False), answers(openai_400), answers(b"not http\r\n\r\n"))(go)


def test_anthropic_shapes_of_replica_errors_and_of_a_cut_stream() -> None:
    kept = {"type": "error", "error": {"type": "not_found_error", "message": "no such model"}}
    assert as_anthropic_error(404, json.dumps(kept).encode()) == kept
    assert as_anthropic_error(500, b"boom") == {"type": "error", "error": {"type": "api_error", "message": "boom"}}
    assert as_anthropic_error(422, b'{"detail": [1]}')["error"] == {"type": "invalid_request_error",
                                                                   "message": "[1]"}
    ending = cut_stream_events("/v1/messages", "gone", b"event: ping\ndata: {}")
    assert ending.startswith(b"\n\nevent: error\ndata: ")
    assert json.loads(ending.split(b"data: ", 1)[1]) == {"type": "error", "error": {"type": "api_error",
                                                                                     "message": "gone"}}


def test_a_fork_goes_to_its_parents_holder_and_the_child_follows_it(tokenizer: Any) -> None:
    forked = json_answer(200, {"id": "child-1", "object": "session", "forked_from": "parent-1"},
                         x_session_id="child-1")
    log: list[str] = []

    async def go(urls: list[str]) -> None:
        other, holder = urls
        client, gateway = await gateway_client(urls, tokenizer)
        owner = key_owner("Bearer key-a")
        gateway.sessions.remember(owner, "parent-1", holder)
        gateway.replicas.replicas[1].load = LoadStats(running=5)          # load alone would pick the other
        async with client:
            auth = {"authorization": "Bearer key-a"}
            fork = await client.post("/v1/context/parent-1/fork", json={"ttl": 60}, headers=auth)
            assert fork.status_code == 200 and fork.headers[REPLICA_HEADER] == holder
            assert log == ["holder"]
            assert gateway.sessions.get(owner, "child-1") == holder
            assert gateway.sessions.get(key_owner("Bearer key-b"), "child-1") is None
            turn = await client.post("/v1/chat/completions", json=CHAT, headers={**auth, "x-session-id": "child-1"})
            assert (turn.headers[REPLICA_HEADER], turn.headers[REASON_HEADER]) == (holder, "session")
        assert other != holder

    served(answers(OK, close=False), counted(forked, log, "holder"))(go)


def test_an_unknown_parent_is_asked_of_each_replica_until_one_knows_it(tokenizer: Any) -> None:
    missing = json_answer(404, {"error": {"message": "no session", "type": "invalid_request_error",
                                          "param": None, "code": None}})
    forked = json_answer(200, {"id": "child-2"}, x_session_id="child-2")

    async def go(urls: list[str]) -> None:
        client, gateway = await gateway_client(urls, tokenizer)
        gateway.replicas.replicas[1].load = LoadStats(running=5)          # load alone would pick the other
        async with client:
            fork = await client.post("/v1/context/parent-2/fork", json={})
            assert fork.status_code == 200 and fork.headers[REPLICA_HEADER] == urls[1]
            assert gateway.sessions.get(key_owner(""), "child-2") == urls[1]

    served(answers(missing), answers(forked))(go)


def test_a_messages_body_goes_to_the_replica_holding_its_rendered_prefix(tokenizer: Any) -> None:
    system = [{"type": "text", "text": "You review pull requests for a storage engine. " * 20,
               "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    first = {**MESSAGES, "system": system, "messages": [{"role": "user", "content": "Review patch one."}]}
    later = {**first, "messages": [{"role": "user", "content": "Now review patch two, please."}]}

    async def go(urls: list[str]) -> None:
        client, gateway = await gateway_client(urls, tokenizer)
        ids = tokenizer.encode(render_chat(tokenizer, messages_chat(first)))
        gateway.indexer.index.add(hash_blocks(ids, 16, root_hash(0, "")), urls[1], "GPU")
        async with client:
            for path in ("/v1/messages", "/v1/messages/count_tokens"):
                answer = await client.post(path, json=later, headers={"x-api-key": "key-a"})
                assert (answer.headers[REPLICA_HEADER], answer.headers[REASON_HEADER]) == (urls[1], "kv")
            refused = {**later, "system": [{"type": "image"}]}        # the replica answers its 400
            assert (await client.post("/v1/messages", json=refused)).headers[REASON_HEADER] == "load"

    served(answers(OK, close=False), answers(OK, close=False))(go)


def test_the_dialect_is_anthropics_on_messages_paths_only() -> None:
    assert is_anthropic("/v1/messages") and is_anthropic("/v1/messages/count_tokens")
    assert is_anthropic("/v1/messages/batches")              # unserved there, but answered in its shape
    assert not is_anthropic("/v1/messagesx") and not is_anthropic("/v1/chat/completions")


def test_tokenizer_info_is_answered_by_a_replica(tokenizer: Any) -> None:
    """``GET /tokenizer_info`` (vLLM's, opt-in on the replicas) passes through the gateway, with the
    replica's own answer: a 200 where the replicas serve it, their 404 where they do not."""
    info = json_answer(200, {"tokenizer_class": "GPT2TokenizerFast", "model_max_length": 8192})

    async def go(urls: list[str]) -> None:
        client, _ = await gateway_client(urls, tokenizer)
        async with client:
            r = await client.get("/tokenizer_info")
            assert r.status_code == 200 and r.json()["tokenizer_class"] == "GPT2TokenizerFast"

    served(answers(info))(go)
    missing = json_answer(404, {"error": {"message": "Not Found", "type": "not_found_error", "code": 404}})

    async def go_missing(urls: list[str]) -> None:
        client, _ = await gateway_client(urls, tokenizer)
        async with client:
            assert (await client.get("/tokenizer_info")).status_code == 404

    served(answers(missing))(go_missing)
