"""The gateway in front of 2 real ``kvhive serve`` replicas (default model, KV events over ZMQ), by HTTP.

The replicas are ``kvhive serve --kv-events ... --kv-events-replay ...`` processes (their block pool
publishes the events; sessions and /v1/context are the server's own). The gateway learns the model
fingerprint, block size and hash seed from the replicas' /v1/models.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx
import pytest
from conftest import REPO_ROOT, SERVED_MODEL_NAME, free_port, log_file

from kvhive.router.cli import add_gateway_args, build_gateway_config, parse_tier_weights, run_gateway
from kvhive.router.config import ReplicaSpec
from kvhive.router.proxy import as_openai_error
from kvhive.router.replicas import parse_load
from kvhive.router.scorer import LoadStats

WORDS = ("alpha beta gamma delta epsilon zeta theta kappa lambda omicron sigma river mountain "
         "valley forest ocean desert garden castle bridge tower market harbor").split()


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class ReplicaProcess:
    """A ``kvhive serve`` process on fixed ports, so it can be killed and started again."""

    port: int = field(default_factory=free_port)
    events_port: int = field(default_factory=free_port)
    replay_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    log_path: str = ""
    extra_args: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def spec(self) -> str:
        return (f"{self.url},events=tcp://127.0.0.1:{self.events_port},"
                f"replay=tcp://127.0.0.1:{self.replay_port},kind=kvhive")

    def start(self) -> None:
        log = log_file(f"kvhive-replica-{self.port}-")
        self.log_path = log.name
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvhive.cli", "serve", "--port", str(self.port),
             "--max-model-len", "1024", "--kv-cache-gb", "0.2", "--num-threads", "1",
             "--log-level", "warning",
             "--kv-events", f"tcp://*:{self.events_port}",
             "--kv-events-replay", f"tcp://*:{self.replay_port}", *self.extra_args],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=_env())

    def wait_healthy(self) -> None:
        def up() -> bool:
            assert self.process is not None and self.process.poll() is None, self.log_tail()
            return healthy(self.url)

        wait_until(up, 120, f"replica {self.url}")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def log_tail(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-3000:]


@dataclass
class Cluster:
    replicas: list[ReplicaProcess]
    gateway_url: str
    gateway: subprocess.Popen[bytes]

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.gateway_url, timeout=60)

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        text = httpx.get(f"{self.gateway_url}/metrics", timeout=10).text
        for line in text.splitlines():
            match = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
            if match and match.group(1) == name:
                found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
                if all(found.get(k) == v for k, v in (labels or {}).items()):
                    return float(match.group(3))
        return 0.0

    def replica_states(self) -> dict[str, str]:
        return httpx.get(f"{self.gateway_url}/health", timeout=5).json()["replicas"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    replicas = [ReplicaProcess(), ReplicaProcess()]
    for r in replicas:
        r.start()
    port = free_port()
    cmd = [sys.executable, "-m", "kvhive.cli", "gateway", "--port", str(port),
           "--health-interval", "0.3", "--failures-to-drop", "1", "--log-level", "warning"]
    for r in replicas:
        cmd += ["--replica", r.spec]
    log = log_file("kvhive-gateway-")
    url = f"http://127.0.0.1:{port}"
    gateway = None
    try:
        for r in replicas:
            r.wait_healthy()
        # Started once the replicas answer, so it reads their fingerprint from /v1/models.
        gateway = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=_env())
        wait_until(lambda: healthy(url) and set(httpx.get(f"{url}/health").json()["replicas"].values())
                   == {"up"}, 60, "the gateway to see both replicas")
        yield Cluster(replicas, url, gateway)
    finally:
        if gateway is not None:
            gateway.terminate()
            try:
                gateway.wait(10)
            except subprocess.TimeoutExpired:
                gateway.kill()
        for r in replicas:
            r.kill()
        with open(log.name, errors="replace") as f:
            print("gateway log tail:\n" + f.read()[-3000:])


def test_the_gateway_imports_no_torch_model_runner_or_server() -> None:
    code = ("import json, sys\n"
            "import kvhive.router.app, kvhive.router.cli, kvhive.core.tenancy\n"
            "print(json.dumps(sorted(sys.modules)))\n")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                       check=True, cwd=REPO_ROOT, env=_env()).stdout)
    forbidden = ("torch", "kvhive.model", "kvhive.engine", "kvhive.server", "kvhive.sessions")
    assert [m for m in loaded if any(m == f or m.startswith(f + ".") for f in forbidden)] == []


def test_replica_flags_and_gateway_config() -> None:
    spec = ReplicaSpec.parse("http://h:8000/,events=tcp://h:5557,replay=tcp://h:5558,kind=vllm")
    assert spec == ReplicaSpec("http://h:8000", "tcp://h:5557", "tcp://h:5558", "vllm")
    assert ReplicaSpec.parse("http://h:1").events is None
    for bad in ("h:1", "http://h:1,kind=sglang", "http://h:1,port=2", "http://h:1,replay=tcp://h:2"):
        with pytest.raises(ValueError):
            ReplicaSpec.parse(bad)
    parser = argparse.ArgumentParser()
    add_gateway_args(parser)
    args = parser.parse_args(["--replica", "http://a:1", "--replica", "http://b:1,kind=vllm",
                              "--tier-weights", "CPU=0.5", "--load-weight", "0.25", "--scorer", "coverage"])
    config = build_gateway_config(args)
    assert [r.kind for r in config.replicas] == ["kvhive", "vllm"]
    assert config.tiers.cpu == 0.5 and config.tiers.gpu == 1.0 and config.weights.load == 0.25
    assert not config.salt_with_api_key
    assert build_gateway_config(parser.parse_args(["--replica", "http://a:1", "--salt-with-api-key"])) \
        .salt_with_api_key
    with pytest.raises(ValueError):
        build_gateway_config(parser.parse_args(["--replica", "http://a:1", "--replica", "http://a:1"]))
    with pytest.raises(ValueError):
        parse_tier_weights("GPU=x")
    assert run_gateway(parser.parse_args([])) == 2          # no replica: a clear error, no traceback


def test_load_from_prometheus_text_and_error_shapes() -> None:
    text = ('# HELP kvhive_num_requests_running x\nkvhive_num_requests_running{model_name="m"} 2.0\n'
            'kvhive_num_requests_waiting{model_name="m"} 1\nkvhive_kv_cache_usage_perc{model_name="m"} 0.5\n'
            'vllm:num_requests_running{model_name="v",engine="0"} 3\nvllm:kv_cache_usage_perc 0.75\n')
    assert parse_load(text) == LoadStats(running=5.0, waiting=1.0, kv_usage=0.75)
    assert parse_load("garbage\n") == LoadStats()
    shaped = {"error": {"message": "m", "type": "t", "param": None, "code": None}}
    assert as_openai_error(400, json.dumps(shaped).encode()) == shaped
    vllm_flat = b'{"object": "error", "message": "bad", "type": "BadRequestError", "code": 400}'
    flat = as_openai_error(400, vllm_flat)
    assert flat["error"]["message"] == "bad" and flat["error"]["code"] == 400
    assert as_openai_error(502, b"upstream exploded")["error"] == {
        "message": "upstream exploded", "type": "server_error", "param": None, "code": None}
    assert as_openai_error(500, b"")["error"]["message"] == "replica answered HTTP 500"


def long_prompt(seed: int, words: int = 220) -> str:
    rng = random.Random(seed)
    return f"Document {seed}. " + " ".join(rng.choice(WORDS) for _ in range(words))


def complete(client: httpx.Client, prompt: str, headers: dict[str, str] | None = None,
             **extra: object) -> httpx.Response:
    body = {"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
    return client.post("/v1/completions", json=body, headers=headers or {})


def test_models_health_and_a_proxied_completion(cluster: Cluster) -> None:
    with cluster.client() as client:
        models = client.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == [SERVED_MODEL_NAME]
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

