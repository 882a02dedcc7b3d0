"""The gateway's parts wired from its config: the block index and session affinity (in memory, or
in the Redis several gateways share), the replicas and their event ingesters, replica discovery,
the HTTP clients, the tokenizer pool and the ``Gateway``; the app's lifespan starts and closes
them, and their state is read into the metrics at scrape time."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import httpx
from fastapi import FastAPI

from kvhive.core.blocks import root_hash
from kvhive.core.tokenizer import Tokenizer
from kvhive.gateway.discovery import RegistryReader, ReplicaDiscovery
from kvhive.gateway.event_watch import EventSilence
from kvhive.gateway.gateway import Gateway
from kvhive.gateway.gateway_config import GatewayConfig, ReplicaSpec
from kvhive.gateway.metrics import GatewayMetrics, InstrumentedIndex, Sample
from kvhive.gateway.replicas import Replica, ReplicaSet
from kvhive.gateway.upstream import UpstreamClient
from kvhive.routing.affinity import SessionAffinity, SharedAffinity
from kvhive.routing.index import InMemoryIndex, KVBlockIndex
from kvhive.routing.indexer import KVCacheIndexer
from kvhive.routing.ingest import BlockKeyMapper, ReplicaIngest
from kvhive.routing.prompts import PromptTokenizer
from kvhive.routing.redis_link import GuardedIndex, RedisLink
from kvhive.routing.scorer import SCORERS


def build_index(config: GatewayConfig, link: RedisLink | None) -> KVBlockIndex:
    """In the Redis behind ``link`` when there is one (``--redis-url``: shared by gateways; a lookup
    finds nothing while Redis is unreachable), else a bounded in-memory LRU."""
    return GuardedIndex(link) if link is not None else InMemoryIndex(config.index_max_keys)


def build_affinity(config: GatewayConfig, link: RedisLink | None,
                   prefix: str = "kvhive:affinity:") -> SessionAffinity | SharedAffinity:
    """Session affinity shared through ``link``'s Redis when there is one (keys under ``prefix``),
    else this gateway's own. Prompt cache keys are kept the same way under ``kvhive:cachekey:``."""
    local = SessionAffinity(config.max_sessions)
    return SharedAffinity(link, config.affinity_ttl_s, local, prefix) if link is not None else local


@dataclass(frozen=True)
class GatewayParts:
    """The wired gateway: the ``Gateway`` its routes call, and what the app's lifespan starts and
    closes (event ingesters, health checks, HTTP clients, the tokenizer pool)."""

    gateway: Gateway
    replicas: list[Replica]
    replica_set: ReplicaSet
    metrics: GatewayMetrics
    index: KVBlockIndex             # as given or built: not instrumented
    prompts: PromptTokenizer
    client: httpx.AsyncClient
    upstream: UpstreamClient
    discovery: ReplicaDiscovery | None = None
    links: tuple[RedisLink, ...] = ()       # the Redis connections to close

    @contextlib.asynccontextmanager
    async def lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        """Start the event ingesters, read the registry (with discovery), check every replica once,
        then keep checking them and polling the registry; on exit stop both and close the clients,
        the ingesters, the Redis connections and the tokenizer pool."""
        for replica in self.replicas:
            if replica.ingest is not None:
                replica.ingest.start()
        if self.discovery is not None:
            await self.discovery.poll()
        await self.replica_set.check_all()
        tasks = [asyncio.create_task(self.replica_set.run())]
        if self.discovery is not None:
            tasks.append(asyncio.create_task(self.discovery.run()))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*tasks)
            await self.client.aclose()
            self.upstream.close()
            for replica in self.replicas:
                if replica.ingest is not None:
                    await asyncio.to_thread(replica.ingest.close)
            self.prompts.close()
            for link in self.links:
                link.close()


def build_gateway(config: GatewayConfig, tokenizer: Tokenizer,
                  index: KVBlockIndex | None = None) -> GatewayParts:
    """Wire the gateway's parts over ``index`` (else the one ``build_index`` builds), instrumented;
    their state is read into the metrics at scrape time."""
    metrics = GatewayMetrics()
    link = RedisLink(config.redis_url) if config.redis_url else None
    raw_index = index if index is not None else build_index(config, link)
    instrumented = InstrumentedIndex(raw_index, metrics)
    root = root_hash(config.hash_seed, config.model_fingerprint)
    client = httpx.AsyncClient(timeout=httpx.Timeout(config.request_limit_s, connect=config.connect_timeout_s),
                               limits=httpx.Limits(max_connections=1000, max_keepalive_connections=200))
    replica_set = ReplicaSet(build_replicas(config, instrumented, root), instrumented, client,
                             config.health_interval_s, config.failures_to_drop)
    discovery, discover_link = build_discovery(config, replica_set, instrumented, root, link)
    prompts = PromptTokenizer(tokenizer, config.prefix_chunk_chars, config.prefix_max_chunks,
                              config.tokenize_workers)
    indexer = KVCacheIndexer(prompts, instrumented, SCORERS[config.scorer](), config.tiers,
                             config.block_size, root)
    upstream = UpstreamClient(connect_timeout_s=config.connect_timeout_s,
                              request_timeout_s=config.request_limit_s)
    gateway = Gateway(replica_set, indexer, build_affinity(config, link), config.weights,
                      metrics, client, config.policy, upstream=upstream,
                      serve_role="decode" if config.disaggregated else None, outliers=config.outliers,
                      cache_keys=build_affinity(config, link, "kvhive:cachekey:"))
    metrics.watch(lambda: _state_samples(gateway, raw_index, prompts))
    if link is not None:
        metrics.watch(lambda: _shared_state_samples(link, raw_index))
    links = tuple({x for x in (link, discover_link) if x is not None})
    # replica_set.replicas is the one list discovery changes: the routes and the lifespan read it.
    return GatewayParts(gateway, replica_set.replicas, replica_set, metrics, raw_index, prompts, client,
                        upstream, discovery, links)


def build_replicas(config: GatewayConfig, index: KVBlockIndex, root: bytes) -> list[Replica]:
    """One Replica per ``config.replicas`` (see ``make_replica``)."""
    return [make_replica(spec, config, index, root) for spec in config.replicas]


def make_replica(spec: ReplicaSpec, config: GatewayConfig, index: KVBlockIndex, root: bytes) -> Replica:
    """A Replica for ``spec``, with an ingester that feeds ``index`` from its KV events where it
    names an event endpoint (block keys chained from ``root``), and a watch on that endpoint."""
    if not spec.events:
        return Replica(spec)
    mapper = BlockKeyMapper(spec.kind != "kvhive", config.block_size, root)
    ingest = ReplicaIngest(spec.name, index, mapper, spec.events, spec.replay)
    return Replica(spec, ingest, events=EventSilence(spec.name, spec.events, config.events_silent_after_s))


def build_discovery(config: GatewayConfig, replica_set: ReplicaSet, index: KVBlockIndex, root: bytes,
                    shared: RedisLink | None = None) -> tuple[ReplicaDiscovery | None, RedisLink | None]:
    """Discovery of the replicas registered at ``discover_url`` (and its Redis link: ``shared``
    when that is the same Redis), or Nones."""
    if config.discover_url is None:
        return None, None
    link = shared if shared is not None and shared.url == config.discover_url else RedisLink(
        config.discover_url, timeout_s=1.0, fallback="keeping the replicas discovered so far")
    discovery = ReplicaDiscovery(RegistryReader(link), replica_set,
                                 lambda spec: make_replica(spec, config, index, root),
                                 config.discover_interval_s, config.model_fingerprint,
                                 static=[r.name for r in config.replicas])
    return discovery, link


def _state_samples(gateway: Gateway, index: KVBlockIndex, prompts: PromptTokenizer) -> Iterator[Sample]:
    """The state of the replicas, their event streams, the index, the sessions and the prefix store as
    samples read at scrape time."""
    now = time.monotonic()
    for r in gateway.replicas.replicas:
        labels = {"replica": r.name}
        yield Sample("kvhive_gateway_replica_up", "1 while the replica passes health checks.", "gauge",
                     labels, float(r.healthy))
        yield Sample("kvhive_gateway_replica_ejected", "1 while the replica is ejected for failing "
                     "requests in a row.", "gauge", labels, float(r.outlier.ejected(now)))
        yield Sample("kvhive_gateway_replica_inflight", "Requests in flight to the replica.", "gauge",
                     labels, float(r.inflight))
        yield Sample("kvhive_gateway_replica_running", "Running requests (last poll).", "gauge",
                     labels, r.load.running)
        yield Sample("kvhive_gateway_replica_waiting", "Waiting requests (last poll).", "gauge",
                     labels, r.load.waiting)
        yield Sample("kvhive_gateway_replica_kv_usage", "KV pool usage 0..1 (last poll).", "gauge",
                     labels, r.load.kv_usage)
        if r.ingest is not None:
            for name, value in vars(r.ingest.stats).items():
                yield Sample(f"kvhive_gateway_kv_event_{name}", f"KV-event stream: {name}.", "counter",
                             labels, float(value))
            yield Sample("kvhive_gateway_kv_event_unmapped_blocks",
                         "Foreign blocks whose kvhive key could not be computed.", "counter", labels,
                         float(r.ingest.mapper.num_unmapped))
    if isinstance(index, InMemoryIndex):
        yield Sample("kvhive_gateway_index_keys", "Block keys in the in-memory index.", "gauge", {},
                     float(len(index)))
    yield Sample("kvhive_gateway_sessions", "Sessions whose replica the gateway knows.", "gauge", {},
                 float(len(gateway.sessions)))
    yield Sample("kvhive_gateway_cache_keys", "prompt_cache_keys whose replica the gateway knows.", "gauge",
                 {}, float(len(gateway.cache_keys)))
    yield Sample("kvhive_gateway_prefix_store_hits", "Prompt chunks found in the prefix store.", "counter",
                 {}, float(prompts.chunk_hits))
    yield Sample("kvhive_gateway_prefix_store_misses", "Prompt chunks tokenized.", "counter", {},
                 float(prompts.chunk_misses))


def _shared_state_samples(link: RedisLink, index: KVBlockIndex) -> Iterator[Sample]:
    """Whether the Redis the gateways share answers, and what its outages cost, read at scrape time."""
    yield Sample("kvhive_gateway_shared_state_up", "1 while the Redis shared by gateways answers "
                 "(0: routing by this gateway's session map and by load).", "gauge", {},
                 float(link.reachable))
    yield Sample("kvhive_gateway_shared_state_failures", "Redis calls that could not reach it.",
                 "counter", {}, float(link.num_failures))
    if isinstance(index, GuardedIndex):
        yield Sample("kvhive_gateway_index_updates_dropped", "Block-index updates dropped while Redis "
                     "was unreachable.", "counter", {}, float(index.num_dropped))
