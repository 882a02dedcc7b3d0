"""``KVAwareRequestRouter`` keeping its block index in a real Redis (``router.index_redis_url``):
a second router, as a second ingress replica holds, routes by the blocks the first one indexed."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray.serve")

import support.ray_routing as routing  # noqa: E402
from support.redis_server import RedisServer  # noqa: E402


def test_routers_sharing_a_redis_index_route_by_each_others_events(redis_server: RedisServer) -> None:
    async def run() -> None:
        replicas = [routing.StandInReplica("a"), routing.StandInReplica("b")]
        first = routing.make_router(replicas, redis_server.url)
        second = routing.make_router(replicas, redis_server.url)
        routing.store_prompt(first, "b", routing.DOCUMENT)
        for question in ("Why?", "How?", "When?"):
            request = routing.envelope(routing.completion(question))
            assert (await routing.ranked(second, replicas, request))[0] == "b"
        assert second.reasons == {"kv": 3}
        first.on_replica_actor_died(replicas[1].replica_id)
        # A replica one router saw die leaves the shared index: the other routes the prompt by load.
        await routing.ranked(second, replicas, routing.envelope(routing.completion("Why?")))
        assert second.reasons.get("load") == 1
        first.routing.close()
        second.routing.close()

    asyncio.run(run())
