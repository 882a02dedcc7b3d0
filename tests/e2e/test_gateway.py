"""The gateway in front of 2 real ``kvhive serve`` replicas (default model, KV events over ZMQ), by HTTP.

The replicas are ``kvhive serve --kv-events ... --kv-events-replay ...`` processes (their block pool
publishes the events; sessions and /v1/context are the server's own). The gateway learns the model
fingerprint, block size and hash seed from the replicas' /v1/models.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest
from support.cluster import Cluster, default_cluster, long_prompt
from support.servers import SERVED_MODEL_NAME, wait_until

from kvhive.gateway.replicas import parse_load


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with default_cluster() as started:
        yield started


def complete(client: httpx.Client, prompt: str, headers: dict[str, str] | None = None,
             **extra: object) -> httpx.Response:
    body = {"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
    return client.post("/v1/completions", json=body, headers=headers or {})


def test_models_health_and_a_proxied_completion(cluster: Cluster) -> None:
    with cluster.client() as client:
        models = client.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == [SERVED_MODEL_NAME]
        assert client.get(f"/v1/models/{SERVED_MODEL_NAME}").json() == models["data"][0]
        unknown = client.get("/v1/models/org/unknown-model")
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
        response = complete(client, "Hello there", max_tokens=5)
        assert response.status_code == 200, response.text
        assert response.headers["x-kvhive-replica"] in {r.url for r in cluster.replicas}
        direct = httpx.post(f"{cluster.replicas[0].url}/v1/completions", timeout=60, json={
            "model": SERVED_MODEL_NAME, "prompt": "Hello there", "max_tokens": 5, "temperature": 0}).json()
        assert response.json()["choices"][0]["text"] == direct["choices"][0]["text"]
        chat = client.post("/v1/chat/completions", json={
            "model": SERVED_MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
        assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"


def test_streaming_passes_through_chunk_by_chunk(cluster: Cluster) -> None:
    body = {"model": SERVED_MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 48, "temperature": 0,
            "ignore_eos": True, "stream": True}
    arrivals: list[float] = []
    raw = b""
    with cluster.client() as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            for chunk in response.iter_raw():
                arrivals.append(time.monotonic())
                raw += chunk
        whole = client.post("/v1/completions", json={**body, "stream": False}).json()
    events = [json.loads(line[6:]) for line in raw.decode().splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert raw.decode().rstrip().endswith("data: [DONE]")
    assert "".join(e["choices"][0]["text"] for e in events) == whole["choices"][0]["text"]
    # Chunks reached the client while generation went on, not all at once at the end.
    assert len(arrivals) >= 3 and arrivals[-1] - arrivals[0] > 0.01


def test_replica_errors_pass_through_in_openai_shape(cluster: Cluster) -> None:
    with cluster.client() as client:
        bad = complete(client, "hi", max_tokens=-1)
        assert bad.status_code == 400
        error = bad.json()["error"]
        assert error["param"] == "max_tokens" and error["type"] == "invalid_request_error"
        unknown = client.post("/v1/completions", json={"model": "nope", "prompt": "hi"})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
        malformed = client.post("/v1/chat/completions", content=b"{not json",
                                headers={"content-type": "application/json"})
        assert malformed.status_code == 400 and "error" in malformed.json()
        stream_error = client.post("/v1/chat/completions", json={
            "model": SERVED_MODEL_NAME, "messages": [], "stream": True})
        assert stream_error.status_code == 400 and stream_error.json()["error"]["param"] == "messages"
        # A query parameter: refused by the gateway on its own routes, by the replica on routed ones.
        for method, url, body in (("GET", "/health?verbose=1", None), ("GET", "/v1/models?limit=1", None),
                                  ("POST", "/tokenize?x=1", {"model": SERVED_MODEL_NAME, "prompt": "hi"}),
                                  ("POST", "/v1/chat/completions?x=1", {
                                      "model": SERVED_MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}]})):
            refused = client.request(method, url, json=body)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == url.split("?")[1].split("=")[0]
            assert url.split("?")[0] in refused.json()["error"]["message"]


def test_a_repeated_long_prompt_goes_to_the_replica_that_served_it(cluster: Cluster) -> None:
    prompts = [long_prompt(seed) for seed in range(6)]
    before = cluster.metric("kvhive_gateway_index_keys")
    wait_until(lambda: all(cluster.metric("kvhive_gateway_replica_running", {"replica": r.url}) == 0
                           for r in cluster.replicas), 10, "idle replicas")
    with cluster.client() as client:
        first = [complete(client, p).headers["x-kvhive-replica"] for p in prompts]
        assert set(first) == {r.url for r in cluster.replicas}       # fresh prompts spread out
        # Each prompt is ~15 full blocks; wait until the replicas' KV events reached the index.
        wait_until(lambda: cluster.metric("kvhive_gateway_index_keys") >= before + 6 * 12, 10,
                   "KV events to reach the gateway's index")
        again = [complete(client, p) for p in prompts]
        assert [r.headers["x-kvhive-replica"] for r in again] == first
        assert {r.headers["x-kvhive-route-reason"] for r in again} == {"kv"}
        assert all(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for r in again)
        # A prompt that extends a cached one also follows its prefix.
        longer = complete(client, prompts[0] + " and then some more words at the end")
        assert longer.headers["x-kvhive-replica"] == first[0]
    assert cluster.metric("kvhive_gateway_routing_decisions_total", {"reason": "kv"}) > 0


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_a_tool_conversation_s_next_turn_goes_to_the_replica_holding_its_kv(cluster: Cluster) -> None:
    # The gateway renders the tools and the call history as the replica does (this model's template
    # reads no tools: kvhive's own format, the definitions in a system message before the user's
    # text), so the second turn's blocks match the first turn's from the first block on.
    asked = [{"role": "user", "content": f"{long_prompt(300)}\nWeather in Paris?"}]
    body = {"model": SERVED_MODEL_NAME, "tools": [WEATHER_TOOL], "max_tokens": 1, "temperature": 0}
    before = cluster.metric("kvhive_gateway_index_keys")
    with cluster.client() as client:
        first = client.post("/v1/chat/completions", json={**body, "messages": asked})
        assert first.status_code == 200, first.text
        holder = first.headers["x-kvhive-replica"]
        wait_until(lambda: cluster.metric("kvhive_gateway_index_keys") >= before + 10, 10,
                   "the first turn's KV events to reach the gateway's index")
        called = [*asked, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
        second = client.post("/v1/chat/completions", json={**body, "messages": called, "tool_choice": "none",
                                                           "chat_template_kwargs": {"unused_variable": 1}})
        assert second.status_code == 200, second.text
        assert (second.headers["x-kvhive-replica"], second.headers["x-kvhive-route-reason"]) == (holder, "kv")
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 10 * 16
        # Tools the replica refuses: the gateway routes the body by load and the replica answers.
        refused = client.post("/v1/chat/completions", json={**body, "messages": called,
                                                            "tools": [WEATHER_TOOL, WEATHER_TOOL]})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools[1]"
        assert refused.headers["x-kvhive-route-reason"] == "load"


def test_sessions_stick_to_their_replica(cluster: Cluster) -> None:
    with cluster.client() as client:
        created = client.post("/v1/context", json={"model": SERVED_MODEL_NAME, "prompt": "Remember me"})
        assert created.status_code == 200
        session_id, holder = created.headers["x-session-id"], created.headers["x-kvhive-replica"]
        for seed in range(4):               # unrelated prompts, but the session decides
            r = complete(client, long_prompt(100 + seed), headers={"x-session-id": session_id})
            assert r.headers["x-kvhive-replica"] == holder
            assert r.headers["x-kvhive-route-reason"] == "session"
        got = client.get(f"/v1/context/{session_id}")
        assert got.status_code == 200 and got.json()["id"] == session_id
        listed = client.get("/v1/context").json()
        assert session_id in [s["id"] for s in listed["data"]]
        assert client.delete(f"/v1/context/{session_id}").status_code == 200
        gone = client.get(f"/v1/context/{session_id}")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "session_not_found"


def test_responses_stick_to_the_replica_that_stored_them(cluster: Cluster) -> None:
    body = {"model": SERVED_MODEL_NAME, "input": "Name a color.", "max_output_tokens": 8, "temperature": 0}
    with cluster.client() as client:
        first = client.post("/v1/responses", json=body)
        assert first.status_code == 200, first.text
        holder, previous = first.headers["x-kvhive-replica"], first.json()
        for turn in range(3):               # follow-ups go where the conversation's KV is
            r = client.post("/v1/responses", json={**body, "input": f"And another? ({turn})",
                                                   "previous_response_id": previous["id"], "stream": turn == 2})
            assert r.status_code == 200, r.text
            assert (r.headers["x-kvhive-replica"], r.headers["x-kvhive-route-reason"]) == (holder, "session")
            if turn < 2:
                previous = r.json()
                assert previous["usage"]["input_tokens_details"]["cached_tokens"] > 0
        for path in (f"/v1/responses/{previous['id']}", f"/v1/responses/{previous['id']}/input_items"):
            got = client.get(path)
            assert got.status_code == 200 and got.headers["x-kvhive-replica"] == holder
        assert client.get(f"/v1/responses/{previous['id']}").json() == previous
        deleted = client.delete(f"/v1/responses/{previous['id']}")
        assert deleted.status_code == 200 and deleted.json()["deleted"] is True
        gone = client.get(f"/v1/responses/{previous['id']}")     # asked of every replica: none has it
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "response_not_found"
        # A response the gateway never saw (stored by a replica directly) is found by asking each.
        other = next(r for r in cluster.replicas if r.url != holder)
        direct = httpx.post(f"{other.url}/v1/responses", json=body, timeout=60).json()
        found = client.get(f"/v1/responses/{direct['id']}")
        assert found.status_code == 200 and found.headers["x-kvhive-replica"] == other.url
        follow = client.post("/v1/responses", json={**body, "previous_response_id": direct["id"]})
        assert follow.status_code == 200 and follow.headers["x-kvhive-replica"] == other.url


def test_a_client_that_leaves_mid_stream_frees_the_replica(cluster: Cluster) -> None:
    body = {"model": SERVED_MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with cluster.client() as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            replica = response.headers["x-kvhive-replica"]
            for i, _ in enumerate(response.iter_raw()):
                if i == 2:
                    break
    # The gateway closes its upstream request, so the replica aborts the generation.
    wait_until(lambda: cluster.metric("kvhive_gateway_replica_inflight", {"replica": replica}) == 0, 10,
               "the gateway to release the request")
    wait_until(lambda: parse_load(httpx.get(f"{replica}/metrics").text).running == 0, 10,
               "the replica to abort it")


def test_dead_replica_is_dropped_and_restored(cluster: Cluster) -> None:
    victim, survivor = cluster.replicas
    with cluster.client() as client:
        created = client.post("/v1/context", json={
            "model": SERVED_MODEL_NAME, "prompt": "session on the victim", "max_tokens": 1})
        assert created.status_code == 200, created.text
        session = {"x-session-id": created.headers["x-session-id"]}
        if created.headers["x-kvhive-replica"] != victim.url:
            victim, survivor = survivor, victim
        cached = long_prompt(200)
        for _ in range(2):
            served = complete(client, cached, headers=session)
            assert served.status_code == 200, served.text
            assert served.headers["x-kvhive-replica"] == victim.url
        wait_until(lambda: cluster.metric("kvhive_gateway_index_keys") > 0, 10, "events")
        victim.kill()
        wait_until(lambda: cluster.replica_states()[victim.url] == "down", 10, "the gateway to drop it")
        assert cluster.metric("kvhive_gateway_replica_up", {"replica": victim.url}) == 0
        # Its blocks left the index: its cached prompt now goes elsewhere, and so does its session.
        for prompt in (cached, long_prompt(201), long_prompt(202)):
            r = complete(client, prompt)
            assert r.status_code == 200 and r.headers["x-kvhive-replica"] == survivor.url
        assert complete(client, long_prompt(203)).headers["x-kvhive-route-reason"] == "load"
        # Its session goes to the survivor, which (no shared Redis tier here) does not know it.
        moved = complete(client, "where is my session", headers=session)
        assert moved.headers["x-kvhive-replica"] == survivor.url
        assert moved.status_code == 404 and moved.json()["error"]["code"] == "session_not_found"

        victim.start()
        victim.wait_healthy()
        wait_until(lambda: cluster.replica_states()[victim.url] == "up", 10, "the gateway to restore it")
        served = {complete(client, long_prompt(300 + i)).headers["x-kvhive-replica"] for i in range(4)}
        assert victim.url in served
        # Its new life's KV events are indexed too: a prompt it served comes back to it.
        batches = {"replica": victim.url}
        seen = cluster.metric("kvhive_gateway_kv_event_batches_total", batches)
        fresh = next(long_prompt(400 + i) for i in range(20)
                     if complete(client, long_prompt(400 + i)).headers["x-kvhive-replica"] == victim.url)
        wait_until(lambda: cluster.metric("kvhive_gateway_kv_event_batches_total", batches) > seen, 10,
                   "the restarted replica's events")
        again = complete(client, fresh)
        assert again.headers["x-kvhive-replica"] == victim.url
        assert again.headers["x-kvhive-route-reason"] == "kv"

