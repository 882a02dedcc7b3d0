"""No tenant oracle in the gateway (real processes): with two API keys, key B naming key A's session,
conversation or stored response gets exactly what it gets for an id nobody ever used.

Two tiny replicas run with ``--api-key A --api-key B`` (they keep sessions and stored responses per
key); two gateways stand in front of them, one with the default KV policy (no KV events here:
routed by load) and one with ``--policy round_robin``, whose answers to unknown ids alternate
between the replicas while a session's stay on its holder.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import pytest
from support.cluster import Cluster, start_gateway, stop_gateway, tiny_replicas
from support.servers import SERVED_MODEL_NAME

KEY_A, KEY_B = "tenant-key-alpha", "tenant-key-beta"
REPLICA, REASON = "x-kvhive-replica", "x-kvhive-route-reason"


@pytest.fixture(scope="module")
def gateways() -> Iterator[tuple[Cluster, Cluster]]:
    with tiny_replicas(2, api_keys=(KEY_A, KEY_B)) as replicas:
        started: list[Cluster] = []
        try:
            for policy in ("kv", "round_robin"):
                started.append(start_gateway(replicas, "--replica-api-key", KEY_A, "--policy", policy,
                                             "--health-interval", "0.5"))
            yield started[0], started[1]
        finally:
            for cluster in started:
                stop_gateway(cluster)


def client(cluster: Cluster, key: str) -> httpx.Client:
    return httpx.Client(base_url=cluster.gateway_url, timeout=60, headers={"authorization": f"Bearer {key}"})


def complete(http: httpx.Client, session_id: str | None = None, **extra: object) -> httpx.Response:
    headers = {"x-session-id": session_id} if session_id else {}
    return http.post("/v1/completions", headers=headers, json={
        "model": SERVED_MODEL_NAME, "prompt": "Tell me a story", "max_tokens": 1, "temperature": 0, **extra})


def seen(response: httpx.Response) -> tuple[int, str | None, str]:
    """What a caller learns from an answer: status, error code, route reason."""
    code = response.json()["error"]["code"] if response.status_code >= 400 else None
    return response.status_code, code, response.headers[REASON]


def fresh(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def test_another_keys_session_id_is_routed_and_answered_as_an_unknown_id(
        gateways: tuple[Cluster, Cluster]) -> None:
    for cluster in gateways:
        with client(cluster, KEY_A) as alice, client(cluster, KEY_B) as bob:
            created = alice.post("/v1/context", json={"model": SERVED_MODEL_NAME, "prompt": "Remember me",
                                                      "max_tokens": 1})
            assert created.status_code == 200, created.text
            session, holder = created.headers["x-session-id"], created.headers[REPLICA]
            for _ in range(2):
                turn = complete(alice, session)
                assert turn.status_code == 200, turn.text
                assert (turn.headers[REPLICA], turn.headers[REASON]) == (holder, "session")

            theirs = [complete(bob, session) for _ in range(4)]
            unknown = [complete(bob, fresh("sess-")) for _ in range(4)]
            expected = (404, "session_not_found", "load" if cluster is gateways[0] else "round_robin")
            assert {seen(r) for r in theirs} == {seen(r) for r in unknown} == {expected}
            if cluster is gateways[1]:          # routed in turn like unknown ids, not to the holder
                assert {r.headers[REPLICA] for r in theirs} == {r.headers[REPLICA] for r in unknown} \
                    == {r.url for r in cluster.replicas}

            # The session's own routes: the same 404 from the same replica, with the same reason.
            for method in ("GET", "DELETE"):
                answers = [bob.request(method, f"/v1/context/{sid}") for sid in (session, fresh("sess-"))]
                assert [(seen(r), r.headers[REPLICA]) for r in answers][0] == \
                    [(seen(r), r.headers[REPLICA]) for r in answers][1]
                assert seen(answers[0])[:2] == (404, "session_not_found")
            kept = alice.get(f"/v1/context/{session}")           # B's DELETE touched nothing
            assert kept.status_code == 200 and kept.headers[REPLICA] == holder
            assert session not in [s["id"] for s in bob.get("/v1/context").json()["data"]]
            # Key A's affinity is intact.
            assert complete(alice, session).headers[REASON] == "session"


def test_another_keys_conversation_and_stored_response_are_unknown_ids(
        gateways: tuple[Cluster, Cluster]) -> None:
    cluster = gateways[0]
    chat = {"model": SERVED_MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    with client(cluster, KEY_A) as alice, client(cluster, KEY_B) as bob:
        conversation = fresh("conv-")
        first = alice.post("/v1/chat/completions", json={**chat, "conversation_id": conversation})
        assert first.status_code == 200 and first.headers[REASON] == "load", first.text
        again = alice.post("/v1/chat/completions", json={**chat, "conversation_id": conversation})
        assert again.headers[REASON] == "session"
        # Key B: an unknown conversation_id starts a conversation of B's own, however A uses the id.
        for cid in (conversation, fresh("conv-")):
            r = bob.post("/v1/chat/completions", json={**chat, "conversation_id": cid})
            assert seen(r) == (200, None, "load"), r.text

        body = {"model": SERVED_MODEL_NAME, "input": "Name a color.", "max_output_tokens": 2}
        stored = alice.post("/v1/responses", json=body)
        assert stored.status_code == 200, stored.text
        response_id, holder = stored.json()["id"], stored.headers[REPLICA]
        follow = alice.post("/v1/responses", json={**body, "previous_response_id": response_id})
        assert (follow.status_code, follow.headers[REPLICA], follow.headers[REASON]) == (200, holder, "session")

        never = "resp_" + uuid.uuid4().hex + uuid.uuid4().hex[:16]         # the 48 hex digits of an id
        continued = [bob.post("/v1/responses", json={**body, "previous_response_id": rid})
                     for rid in (response_id, never)]
        assert seen(continued[0]) == seen(continued[1])
        assert seen(continued[0])[0] == 404 and seen(continued[0])[2] == "load"
        for suffix in ("", "/input_items"):
            got = [bob.get(f"/v1/responses/{rid}{suffix}") for rid in (response_id, never)]
            assert (seen(got[0]), got[0].headers[REPLICA]) == (seen(got[1]), got[1].headers[REPLICA])
            assert seen(got[0])[:2] == (404, "response_not_found")
        assert alice.get(f"/v1/responses/{response_id}").headers[REASON] == "session"
