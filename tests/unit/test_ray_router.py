"""``KVAwareRequestRouter`` driven by Ray's own router machinery with stand-in replicas: KV events
fed to its index decide where a prompt goes, a session's holder comes first, a dead replica's
blocks leave the index, and requests without a prompt go by load."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

pytest.importorskip("ray.serve")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata  # noqa: E402
from ray.serve.request_router import PendingRequest, ReplicaID  # noqa: E402

from kvhive.core.blocks import ExtraKeys, hash_blocks, root_hash  # noqa: E402
from kvhive.core.model_files import default_model_path  # noqa: E402
from kvhive.core.tokenizer import Tokenizer  # noqa: E402
from kvhive.integrations.ray.envelope import HTTPEnvelope  # noqa: E402
from kvhive.integrations.ray.router import KVAwareRequestRouter  # noqa: E402
from kvhive.kv.events import BlockStored, EventBatch  # noqa: E402

DEPLOYMENT = DeploymentID(name="KVHiveReplica", app_name="kvhive")
FINGERPRINT = "0123456789abcdef"
DOCUMENT = "Rivers carve valleys over many thousands of years while the plains wait quietly. " * 12


class StandInReplica:
    """What the router reads of a running replica: its id, metadata, routing stats and queue."""

    def __init__(self, unique_id: str, running: int = 0) -> None:
        self.replica_id = ReplicaID(unique_id, DEPLOYMENT)
        self.replica_metadata = {"model_path": default_model_path(), "block_size": 16, "hash_seed": 0,
                                 "fingerprint": FINGERPRINT, "kv_events": None, "kv_events_replay": None}
        self.routing_stats = {"running": running, "waiting": 0, "kv_usage": 0.0}
        self.running = running
        self.max_ongoing_requests = 16
        self.node_id = "node"
        self.availability_zone = None
        self.multiplexed_model_ids: set[str] = set()
        self.is_cross_language = False

    async def get_queue_len(self, *, deadline_s: float) -> int:
        """The replica's requests in flight."""
        return self.running


def envelope(body: dict[str, Any] | None = None, headers: tuple[tuple[str, str], ...] = (),
             holder: str | None = None, method: str = "POST", path: str = "/v1/completions") -> HTTPEnvelope:
    """A request as the ingress forwards it."""
    raw = json.dumps(body).encode() if body is not None else b""
    return HTTPEnvelope(method, path, b"", headers, raw, holder)


def pending(env: HTTPEnvelope) -> PendingRequest:
    """Ray's pending request carrying ``env``."""
    return PendingRequest(args=[env], kwargs={}, metadata=RequestMetadata(request_id="r", internal_request_id="r"))


def store_prompt(router: KVAwareRequestRouter, replica: str, text: str) -> int:
    """Publish to ``replica``'s event stream that it holds every full block of ``text`` (as a
    completion prompt with the tokenizer's BOS); the number of blocks."""
    ids = Tokenizer.from_model_path(default_model_path()).encode(text, add_special_tokens=True)
    keys = hash_blocks(ids, 16, root_hash(0, FINGERPRINT), ExtraKeys(cache_salt=None))
    ingest = router.routing.ingests[replica]
    ingest.apply(EventBatch(0.0, [BlockStored(list(keys), None, ids[:len(keys) * 16], 16)]))
    return len(keys)


def make_router(replicas: list[StandInReplica]) -> KVAwareRequestRouter:
    """A router over ``replicas``, as Ray builds it in a caller's process."""
    router = KVAwareRequestRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
    router.initialize_state(scorer="longest_prefix")
    router.update_replicas(replicas)   # type: ignore[arg-type]
    return router


async def ranked(router: KVAwareRequestRouter, replicas: list[StandInReplica], env: HTTPEnvelope) -> list[str]:
    """The unique ids in the order the router offers them."""
    ranks = await router.choose_replicas(replicas, pending(env))   # type: ignore[arg-type]
    assert all(len(rank) == 1 for rank in ranks)
    return [rank[0].replica_id.unique_id for rank in ranks]


def completion(question: str) -> dict[str, Any]:
    """A completion body over the shared document."""
    return {"model": "m", "prompt": DOCUMENT + question, "max_tokens": 4}


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


def test_requests_without_a_prompt_go_to_the_least_loaded_replica() -> None:
    async def run() -> None:
        replicas = [StandInReplica("a", running=4), StandInReplica("b", running=0)]
        router = make_router(replicas)
        assert (await ranked(router, replicas, envelope(method="GET", path="/v1/models")))[0] == "b"
        assert (await ranked(router, replicas, envelope({"model": "m", "prompt": 7})))[0] == "b"
        router.routing.close()

    asyncio.run(run())


def test_the_envelope_names_the_session_a_request_continues() -> None:
    assert envelope(headers=(("x-session-id", "s1"),)).session_named(None) == "s1"
    assert envelope().session_named({"conversation_id": "c1"}) == "c1"
    assert envelope().session_named({"previous_response_id": "resp_1"}) == "resp_1"
    assert envelope(method="GET", path="/v1/context/s9").session_named(None) == "s9"
    assert envelope(method="GET", path="/v1/responses/resp_2/input_items").session_named(None) == "resp_2"
    assert envelope().session_named({"prompt": "hi"}) is None
