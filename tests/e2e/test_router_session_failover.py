"""A session outlives its replica: with a shared Redis tier, the gateway sends the session's next
turn to another replica, which loads the session and its KV from Redis (real processes).

Two ``kvhive serve`` replicas on the default model share one ``redis-server`` (``--redis-url``);
the gateway routes by their KV events. The replica holding a session is killed; the next turn with
the session's ``x-session-id`` goes to the survivor and reports cached tokens.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
from conftest import REPO_ROOT, SERVED_MODEL_NAME, free_port, log_file
from test_gateway import Cluster, ReplicaProcess, _env, healthy, long_prompt, wait_until

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None and not os.environ.get("CI"),
                                reason="redis-server is not installed")


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    workdir = str(tmp_path_factory.mktemp("redis"))
    process = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                "--appendonly", "no", "--dir", workdir],
                               stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        import redis

        def up() -> bool:
            try:
                return bool(redis.Redis.from_url(url, socket_timeout=1).ping())
            except redis.ConnectionError:
                return False

        wait_until(up, 10, "redis-server")
        yield url
    finally:
        process.terminate()
        process.wait(10)


@pytest.fixture(scope="module")
def redis_cluster(redis_url: str) -> Iterator[Cluster]:
    replicas = [ReplicaProcess(extra_args=("--redis-url", redis_url)) for _ in range(2)]
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
        for r in replicas:
            print(f"replica {r.url} log tail:\n{r.log_tail()}")
        with open(log.name, errors="replace") as f:
            print("gateway log tail:\n" + f.read()[-3000:])


def cached_tokens(response: httpx.Response) -> int:
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_session_moves_to_another_replica_through_the_redis_tier(redis_cluster: Cluster) -> None:
    history = long_prompt(500, words=200)
    with redis_cluster.client() as client:
        created = client.post("/v1/context", json={"model": SERVED_MODEL_NAME, "prompt": history,
                                                   "max_tokens": 4, "temperature": 0})
        assert created.status_code == 200, created.text
        session = {"x-session-id": created.headers["x-session-id"]}
        holder = created.headers["x-kvhive-replica"]
        history += created.json()["choices"][0]["text"] + " And then?"
        turn = client.post("/v1/completions", headers=session, json={
            "model": SERVED_MODEL_NAME, "prompt": history, "max_tokens": 4, "temperature": 0})
        assert turn.status_code == 200, turn.text
        assert turn.headers["x-kvhive-replica"] == holder
        assert turn.headers["x-kvhive-route-reason"] == "session"
        assert cached_tokens(turn) > 0
        history += turn.json()["choices"][0]["text"] + " Go on."

        victim = next(r for r in redis_cluster.replicas if r.url == holder)
        survivor = next(r for r in redis_cluster.replicas if r.url != holder)
        victim.kill()
        wait_until(lambda: redis_cluster.replica_states()[victim.url] == "down", 10,
                   "the gateway to drop the session's replica")

        moved = client.post("/v1/completions", headers=session, json={
            "model": SERVED_MODEL_NAME, "prompt": history, "max_tokens": 4, "temperature": 0})
        assert moved.headers["x-kvhive-replica"] == survivor.url
        # The survivor never computed this history: what it finds cached came from the Redis tier.
        plain = client.post("/v1/completions", json={
            "model": SERVED_MODEL_NAME, "prompt": history, "max_tokens": 1, "temperature": 0})
        assert plain.status_code == 200 and plain.headers["x-kvhive-replica"] == survivor.url
        assert cached_tokens(plain) >= 16 * 10
        assert moved.status_code == 200, moved.text
        assert cached_tokens(moved) >= 16 * 10
        # The session now lives on the survivor, and its next turn stays there.
        again = client.post("/v1/completions", headers=session, json={
            "model": SERVED_MODEL_NAME, "prompt": history + moved.json()["choices"][0]["text"],
            "max_tokens": 1, "temperature": 0})
        assert again.status_code == 200 and again.headers["x-kvhive-replica"] == survivor.url
        assert again.headers["x-kvhive-route-reason"] == "session"
