"""Gateway metrics: a wrapper that instruments any index, and the gateway's Prometheus registry.

As in llm-d, the index knows nothing of metrics; ``InstrumentedIndex`` wraps it. State owned by other
parts (replica health and load, event streams, prefix store) is read at scrape time through a
callable, so those parts keep plain counters and no Prometheus objects.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from kvhive.routing.index import KVBlockIndex

_LOOKUP_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)
_TOKENIZE_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)


class Sample(NamedTuple):
    """One value read at scrape time."""

    name: str
    doc: str
    kind: str                 # "gauge" or "counter"
    labels: dict[str, str]
    value: float


class GatewayMetrics:
    """The gateway's registry: routing decisions, index and tokenizer latency, upstream results."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.decisions = Counter("kvhive_gateway_routing_decisions",
                                 "Requests routed, by replica and reason (session, kv, cache_key, load, retry).",
                                 ["replica", "reason"], registry=self.registry)
        self.routed_cached_blocks = Counter("kvhive_gateway_routed_cached_blocks",
                                            "Tier-weighted blocks the index said the chosen replica held.",
                                            ["replica"], registry=self.registry)
        self.responses = Counter("kvhive_gateway_responses", "Upstream responses by replica and status.",
                                 ["replica", "status"], registry=self.registry)
        self.upstream_errors = Counter("kvhive_gateway_upstream_errors",
                                       "Requests whose answer from a replica failed (none came, it was "
                                       "cut, too late or not HTTP or the JSON expected).", ["replica"],
                                       registry=self.registry)
        self.upstream_failures = Counter("kvhive_gateway_upstream_failures",
                                         "Failed requests by replica and kind (5xx, connect, "
                                         "connect_timeout, reset, timeout, malformed, cut): what outlier "
                                         "ejection counts.", ["replica", "kind"], registry=self.registry)
        self.timeouts = Counter("kvhive_gateway_upstream_timeouts",
                                "Requests cut by --request-timeout, by replica.", ["replica"],
                                registry=self.registry)
        self.ejections = Counter("kvhive_gateway_outlier_ejections",
                                 "Times a replica was ejected for failing requests in a row.", ["replica"],
                                 registry=self.registry)
        self.outlier_panic = Counter("kvhive_gateway_outlier_panic",
                                     "Requests routed among ejected replicas because every candidate "
                                     "was ejected.", registry=self.registry)
        self.retries = Counter("kvhive_gateway_retries",
                               "Requests sent to another replica after a failure before any byte reached "
                               "the client (reason: connect, connect_timeout, reset, 5xx, malformed).",
                               ["reason"], registry=self.registry)
        self.stream_errors = Counter("kvhive_gateway_stream_errors",
                                     "Answers a replica cut part-way (an SSE stream ends with an error "
                                     "event, a whole JSON body is a 502).", ["replica"],
                                     registry=self.registry)
        self.lookup_seconds = Histogram("kvhive_gateway_index_lookup_seconds",
                                        "Index lookup time per request.", buckets=_LOOKUP_BUCKETS,
                                        registry=self.registry)
        self.index_updates = Counter("kvhive_gateway_index_updates", "Index calls by operation.",
                                     ["op"], registry=self.registry)
        self.tokenize_seconds = Histogram("kvhive_gateway_tokenize_seconds",
                                          "Prompt tokenization time per request.",
                                          buckets=_TOKENIZE_BUCKETS, registry=self.registry)

    def watch(self, samples: Callable[[], Iterable[Sample]]) -> None:
        """Export what ``samples`` returns at each scrape."""
        self.registry.register(_SampleCollector(samples))

    def render(self) -> tuple[bytes, str]:
        """Prometheus text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class InstrumentedIndex:
    """A KVBlockIndex that times lookups and counts updates; behaves exactly as the index it wraps."""

    def __init__(self, inner: KVBlockIndex, metrics: GatewayMetrics) -> None:
        self.inner = inner
        self._metrics = metrics

    def add(self, keys: Sequence[bytes], replica: str, medium: str) -> None:
        """See KVBlockIndex.add."""
        self._metrics.index_updates.labels("add").inc()
        self.inner.add(keys, replica, medium)

    def remove(self, keys: Sequence[bytes], replica: str, medium: str) -> None:
        """See KVBlockIndex.remove."""
        self._metrics.index_updates.labels("remove").inc()
        self.inner.remove(keys, replica, medium)

    def clear_replica(self, replica: str) -> None:
        """See KVBlockIndex.clear_replica."""
        self._metrics.index_updates.labels("clear_replica").inc()
        self.inner.clear_replica(replica)

    def lookup(self, keys: Sequence[bytes]) -> list[dict[str, str]]:
        """See KVBlockIndex.lookup; the time taken goes to kvhive_gateway_index_lookup_seconds."""
        start = time.perf_counter()
        try:
            return self.inner.lookup(keys)
        finally:
            self._metrics.lookup_seconds.observe(time.perf_counter() - start)


class _SampleCollector(Collector):
    def __init__(self, samples: Callable[[], Iterable[Sample]]) -> None:
        self._samples = samples

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for s in self._samples():
            family = families.get(s.name)
            if family is None:
                cls = GaugeMetricFamily if s.kind == "gauge" else CounterMetricFamily
                family = families[s.name] = cls(s.name, s.doc, labels=list(s.labels))
            family.add_metric(list(s.labels.values()), s.value)
        yield from families.values()
