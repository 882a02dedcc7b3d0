"""A session survives a Ray Serve scale-down: on a two-node Ray cluster, two kvhive replicas share a
redis-server tier; each holds a long session; the deployment is scaled to one replica (Ray's
per-deployment ``num_replicas`` override, deployed again as ``serve deploy`` does). The stopped
replica drains its sessions into Redis, and the next turn of its session, answered by the
survivor, is cached and greedy-equal to the answer given before the scale-down. The KV blocks
Redis got when they were computed are deleted first: only the drain (copying from the stopping
replica's CPU tier) can put them back."""

from __future__ import annotations

import glob
import re
import subprocess
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml

pytest.importorskip("ray.serve")

import support.ray_cluster as ray_support  # noqa: E402
from support.redis_server import RedisServer  # noqa: E402
from support.servers import REPO_ROOT, free_port, wait_until  # noqa: E402

pytestmark = pytest.mark.ray

MODEL = "smollm2-135m"
TOPICS = ("the tides of the northern sea and the boats that wait for them",
          "an old observatory on a hill and the people who kept it running",
          "how a town library lent its books through a hard winter",
          "the long road of a letter carried across three countries")


def history(topic: str) -> str:
    """A long session opening (about 400 tokens) of its own about ``topic``."""
    return " ".join(f"Part {i} of the story of {topic}, told with care and detail." for i in range(24))


def complete(client: httpx.Client, prompt: str, **extra: Any) -> httpx.Response:
    """POST /v1/completions, greedy, eight tokens."""
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 8,
                                                     "temperature": 0}, **extra)
    assert response.status_code == 200, response.text
    return response


def cached_tokens(response: httpx.Response) -> int:
    """The answer's cached prompt tokens."""
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def cluster(module_redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Two Ray nodes of one CPU each running the example config with a Redis tier: the cluster,
    the config's path and a client of the application."""
    port = free_port()
    config = ray_support.write_config(str(tmp_path_factory.mktemp("ray") / "config.yaml"), port,
                          redis_url=module_redis_server.url, cpu_offload_gb=0.25)
    with ray_support.ray_cluster(num_nodes=2, cpus_per_node=1) as running, ray_support.serve_run(running, config) as run:
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120.0)

        ray_support.wait_for_app(run, client)
        yield running, config, client, module_redis_server
        client.close()


def scale_to_one(cluster: ray_support.RayCluster, config_path: str) -> None:
    """Deploy the config again with KVHiveReplica's num_replicas overridden to 1 (as ``serve deploy``)."""
    with open(config_path) as f:
        config = yaml.safe_load(f)
    config["applications"][0]["deployments"] = [{"name": "KVHiveReplica", "num_replicas": 1}]
    scaled = config_path.replace(".yaml", "-one.yaml")
    with open(scaled, "w") as f:
        yaml.safe_dump(config, f)
    subprocess.run(["serve", "run", "--non-blocking", scaled, "--address", cluster.address], cwd=REPO_ROOT,
                   env=cluster.env, check=True, timeout=120, capture_output=True)


def sessions_on_both_replicas(client: httpx.Client) -> dict[str, dict[str, str]]:
    """Sessions created through the ingress until both replicas hold one: by holder, the
    session's id and its conversation so far."""
    held: dict[str, dict[str, str]] = {}
    for topic in TOPICS:
        opening = history(topic)
        created = client.post("/v1/context", headers={"x-session-ttl": "600"},
                              json={"model": MODEL, "prompt": opening, "max_tokens": 4, "temperature": 0})
        assert created.status_code == 200, created.text
        conversation = opening + created.json()["choices"][0]["text"] + " What happened next?"
        held.setdefault(created.headers["x-kvhive-replica"],
                        {"id": created.headers["x-session-id"], "conversation": conversation})
        if len(held) == 2:
            return held
    raise AssertionError(f"sessions all landed on {list(held)}")


def test_a_session_survives_a_scale_down_with_its_next_turn_cached(cluster: Any) -> None:
    ray, config_path, client, redis = cluster
    held = sessions_on_both_replicas(client)
    # What each session's next turn answers, asked (without the session) before the scale-down.
    expected = {holder: complete(client, s["conversation"]).json()["choices"][0]["text"]
                for holder, s in held.items()}
    admin = redis.admin()
    blocks = list(admin.scan_iter(match="kvhive:*:kv:*"))
    assert blocks, "the replicas wrote their blocks through to Redis"
    admin.delete(*blocks)
    scale_to_one(ray, config_path)
    wait_until(lambda: len(ray_support.replica_pids()) == 1, 120, "Ray stopping one of the two replicas")
    for holder, session in held.items():
        turn = complete(client, session["conversation"], headers={"x-session-id": session["id"]})
        prompt_tokens = turn.json()["usage"]["prompt_tokens"]
        assert cached_tokens(turn) >= prompt_tokens - 32, (holder, turn.json()["usage"])
        assert turn.json()["choices"][0]["text"] == expected[holder]
    survivor = turn.headers["x-kvhive-replica"]
    assert survivor in held, "the survivor is one of the two replicas"
    moved = next(holder for holder in held if holder != survivor)
    logs = "".join(open(path, errors="replace").read()
                   for path in glob.glob(f"{ray.temp_dir}/session_latest/logs/**/*", recursive=True)
                   if path.endswith((".log", ".err", ".out")))
    drained = re.search(rf"kvhive replica {moved} drained: DrainReport\(sessions=(\d+), blocks=(\d+), "
                        rf"in_shared_tier=(\d+), copied=(\d+)", logs)
    assert drained is not None, "the stopped replica logged its drain"
    sessions, blocks, in_shared_tier, copied = map(int, drained.groups())
    assert sessions >= 1 and copied >= 1 and in_shared_tier == blocks, drained.group(0)
