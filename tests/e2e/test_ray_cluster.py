"""kvhive as a Ray Serve application on a two-node Ray cluster on this machine, started with
``serve run examples/ray/config.yaml`` as README says: repeats of long prompts reach the replica
holding their prefix, a session created through the ingress is used through it, a replica killed
with SIGKILL is replaced by Ray while traffic goes on, and bad configs are refused."""

from __future__ import annotations

import os
import random
import signal
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytest.importorskip("ray.serve")

import support.ray_cluster as ray_support  # noqa: E402
from support.ray_cluster import RayCluster, ray_cluster, replica_pids, serve_run, write_config  # noqa: E402
from support.servers import free_port, wait_until  # noqa: E402

pytestmark = pytest.mark.ray

MODEL = "smollm2-135m"
TOPICS = ("river valleys and the slow work of water", "the first printing presses of Europe",
          "how bees decide where to build a new hive", "the chemistry of bread dough rising")


def document(topic: str) -> str:
    """A long prompt (about 300 tokens) of its own about ``topic``."""
    return " ".join(f"Paragraph {i} about {topic} goes on with more detail on {topic}." for i in range(20))


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    """Two Ray nodes of one CPU each; stopped with ``ray stop`` whatever happens."""
    with ray_cluster(num_nodes=2, cpus_per_node=1) as running:
        yield running


@pytest.fixture(scope="module")
def http_port() -> int:
    """The one HTTP port every config of this module names: Ray Serve keeps the HTTP options of its
    first start for the cluster's life, so a later ``serve run`` naming another port is not served."""
    return free_port()


# One bad config through `serve run` (about a minute of Ray's own start and report); every other
# refusal of the application's args is checked without a cluster in tests/unit/test_ray_config.py.
@pytest.mark.parametrize(("args", "named"), [({"kv_cache_gigs": 1}, "unknown field 'kv_cache_gigs'")])
def test_a_bad_config_is_refused_and_starts_nothing(cluster: RayCluster, tmp_path: Any, http_port: int,
                                                    args: dict[str, Any], named: str) -> None:
    config = write_config(str(tmp_path / "bad.yaml"), http_port, **args)
    with serve_run(cluster, config) as run:
        wait_until(lambda: named in run.output(), 120, f"serve run reporting {named}")
        assert replica_pids() == []


def test_resources_no_node_has_are_refused_by_name(cluster: RayCluster) -> None:
    import ray

    from kvhive.integrations.ray import ConfigError, build_app

    ray.init(address=cluster.address, logging_level="ERROR")
    try:
        with pytest.raises(ConfigError, match="ray_actor_options: no node"):
            build_app({"num_threads": 1, "ray_actor_options": {"num_cpus": 8}})
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def app(cluster: RayCluster, tmp_path_factory: pytest.TempPathFactory, http_port: int) -> Iterator[httpx.Client]:
    """The example config's application (2 replicas, one thread each) behind Ray's proxy."""
    port = http_port
    config = write_config(str(tmp_path_factory.mktemp("ray") / "config.yaml"), port)
    with serve_run(cluster, config) as run:
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120.0)

        ray_support.wait_for_app(run, client)
        yield client
        client.close()


def complete(client: httpx.Client, prompt: str, **extra: Any) -> httpx.Response:
    """POST /v1/completions with a short answer."""
    return client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 3,
                                                "temperature": 0}, **extra)


def test_repeated_long_prompts_reach_the_replica_holding_them(app: httpx.Client) -> None:
    prompts = [document(t) for t in TOPICS]
    holders = {}
    for prompt in prompts:
        first = complete(app, prompt)
        assert first.status_code == 200, first.text
        holders[prompt] = first.headers["x-kvhive-replica"]
    repeats = prompts * 3
    random.Random(7).shuffle(repeats)
    cached = total = 0
    for prompt in repeats:
        answer = complete(app, prompt)
        assert answer.status_code == 200, answer.text
        usage = answer.json()["usage"]
        cached += usage["prompt_tokens_details"]["cached_tokens"]
        total += usage["prompt_tokens"]
        assert answer.headers["x-kvhive-replica"] == holders[prompt]
    assert cached / total >= 0.9, (cached, total)


def test_a_session_created_through_the_ingress_is_used_through_it(app: httpx.Client) -> None:
    opening = document("a long conversation about tide pools")
    created = app.post("/v1/context", headers={"x-session-ttl": "300"},
                       json={"model": MODEL, "prompt": opening, "max_tokens": 3, "temperature": 0})
    assert created.status_code == 200, created.text
    session = created.headers["x-session-id"]
    holder = created.headers["x-kvhive-replica"]
    turn = complete(app, opening + " And what lives there?", headers={"x-session-id": session})
    assert turn.status_code == 200, turn.text
    assert turn.headers["x-kvhive-replica"] == holder
    assert turn.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 200
    shown = app.get(f"/v1/context/{session}")
    assert shown.status_code == 200 and shown.headers["x-kvhive-replica"] == holder
    assert app.delete(f"/v1/context/{session}").status_code == 200
    assert app.get(f"/v1/context/{session}").status_code == 404


def test_errors_streams_and_metrics_come_through_as_from_kvhive_serve(app: httpx.Client) -> None:
    refused = app.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": -1})
    assert refused.status_code == 400
    assert set(refused.json()["error"]) == {"message", "type", "param", "code"}
    with app.stream("POST", "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4,
            "stream": True}) as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    assert "kvhive_" in app.get("/metrics").text
    assert app.get("/health").status_code == 200


def test_a_killed_replica_is_replaced_and_traffic_goes_on(app: httpx.Client) -> None:
    before = set(replica_pids())
    assert len(before) == 2
    in_flight: list[httpx.Response | Exception] = []

    def long_request() -> None:
        try:
            in_flight.append(app.post("/v1/completions", json={"model": MODEL, "prompt": document("kites"),
                                                               "max_tokens": 64, "temperature": 0}))
        except httpx.HTTPError as exc:
            in_flight.append(exc)

    worker = threading.Thread(target=long_request)
    worker.start()
    victim = sorted(before)[0]
    os.kill(victim, signal.SIGKILL)
    # Every request sent after the kill is answered: the router drops the dead replica, and a
    # request it had already been given before dying is sent once more.
    statuses = [complete(app, document(t)).status_code for t in TOPICS]
    assert statuses == [200] * len(TOPICS)
    worker.join(timeout=120)
    # The request in flight during the kill is answered whole (it ran on the survivor, or had no
    # answer yet from the victim and was sent again) or, had the victim begun answering it, ends
    # short; it never hangs.
    assert len(in_flight) == 1
    print("request in flight during the kill:", in_flight[0] if isinstance(in_flight[0], Exception)
          else (in_flight[0].status_code, in_flight[0].headers.get("x-kvhive-replica")))
    wait_until(lambda: len(replica_pids()) == 2 and victim not in replica_pids(), 180,
               "Ray replacing the killed replica")
    seen = set()
    for _ in range(8):
        answer = complete(app, document("a new replica"))
        assert answer.status_code == 200, answer.text
        seen.add(answer.headers["x-kvhive-replica"])
    assert statuses and seen
