"""Ray's request-router machinery driven with stand-in replicas: what the router reads of a running
replica, requests as the ingress forwards them, and KV events fed straight to the router's ingesters."""

from __future__ import annotations

import json
from typing import Any

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

from kvhive.core.blocks import ExtraKeys, hash_blocks, root_hash
from kvhive.core.kv_events import BlockStored, EventBatch
from kvhive.core.model_files import default_model_path
from kvhive.core.tokenizer import Tokenizer
from kvhive.integrations.ray.envelope import HTTPEnvelope
from kvhive.integrations.ray.router import KVAwareRequestRouter

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
             holder: str | None = None, method: str = "POST", path: str = "/v1/completions",
             key_holder: str | None = None) -> HTTPEnvelope:
    """A request as the ingress forwards it."""
    raw = json.dumps(body).encode() if body is not None else b""
    return HTTPEnvelope(method, path, b"", headers, raw, holder, key_holder)


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


def make_router(replicas: list[StandInReplica], index_redis_url: str | None = None) -> KVAwareRequestRouter:
    """A router over ``replicas``, as Ray builds it in a caller's process."""
    router = KVAwareRequestRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
    router.initialize_state(scorer="longest_prefix", index_redis_url=index_redis_url)
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
