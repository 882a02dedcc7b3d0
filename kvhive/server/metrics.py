"""Prometheus metrics of one app: request counts and latencies observed per request, engine state
read at scrape.

Every metric lives in the app's own ``CollectorRegistry`` (two apps in one process never share
one). Engine-level values come from ``engine.stats()`` each time ``/metrics`` is scraped
(``metrics_collectors.py``), so the engine keeps no Prometheus objects: core classes return stats,
the edge exports metrics. Request latencies combine the server's clock (arrival, each output
received) with the times the engine stamps on its outputs (queued, first scheduled, produced);
both are ``time.monotonic`` of this one process. With ``--metrics-compat vllm`` every family that
vLLM also has is exported a second time under vLLM's name (``metrics_vllm.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from kvhive.server.dashboard_usage import CURRENT_KEY_USAGE
from kvhive.server.metrics_collectors import (
    EngineStatsCollector,
    ResponseStatsCollector,
    SessionStatsCollector,
)
from kvhive.server.metrics_vllm import check_metrics_compat, with_vllm_names

if TYPE_CHECKING:
    from kvhive.config import EngineConfig
    from kvhive.engine.llm_engine import RequestOutput
    from kvhive.engine.stats import EngineStats
    from kvhive.sessions.registry import SessionStats
    from kvhive.sessions.response_store import ResponseStats

# Bucket bounds as vLLM v1 has them, so dashboards' quantiles read the same on both.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# The finish reasons a request ends with; each has its series from the start (at 0).
FINISH_REASONS = ("stop", "length", "abort", "error")


def token_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (bounds for per-request token counts)."""
    bounds, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(bounds)
            bounds.append(mantissa * scale)
        scale *= 10


class ServerMetrics:
    """The app's registry: request counters and histograms, plus the collectors of engine, session
    and response state; ``compat`` ("none" or "vllm") adds vLLM's names."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str, *, max_model_len: int = 8192,
                 compat: str = "none") -> None:
        check_metrics_compat(compat)
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._compat = compat
        self._engine_stats = stats
        self._requests = self._add(Counter("kvhive_request_finished", "Finished requests by finish reason "
                                           "(stop, length, abort, error).", ["model_name", "finished_reason"],
                                           registry=None))
        self._by_reason = {reason: self._requests.labels(model_name, reason) for reason in FINISH_REASONS}
        self.prompt_tokens = self.counter("kvhive_prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = self.counter("kvhive_generation_tokens", "Generated tokens of finished requests.")
        self.ttft = self.histogram("kvhive_time_to_first_token_seconds",
                                    "Time from request arrival to its first generated token.", TTFT_BUCKETS)
        self.itl = self.histogram("kvhive_inter_token_latency_seconds",
                                   "Time between consecutive generated tokens of one request.", ITL_BUCKETS)
        self.phases = RequestPhaseHistograms(self)
        tokens = token_buckets(max_model_len)
        self.request_prompt_tokens = self.histogram("kvhive_request_prompt_tokens",
                                                     "Prompt tokens per finished request.", tokens)
        self.request_generation_tokens = self.histogram("kvhive_request_generation_tokens",
                                                         "Generated tokens per finished request.", tokens)
        self.max_tokens_param = self.histogram("kvhive_request_params_max_tokens",
                                                "The max_tokens of each finished request (the room left in "
                                                "the context when the request set none).", tokens)
        self._add(EngineStatsCollector(stats, model_name))

    def _add(self, collector: Collector):
        """Register ``collector`` (with its vLLM aliases when asked) and return it."""
        self.registry.register(with_vllm_names(collector, self._compat))
        return collector

    def counter(self, name: str, doc: str):
        """A counter labelled with the model name; returns its one child."""
        return self._add(Counter(name, doc, ["model_name"], registry=None)).labels(self.model_name)

    def histogram(self, name: str, doc: str, buckets: Sequence[float]):
        """A histogram labelled with the model name; returns its one child."""
        return self._add(Histogram(name, doc, ["model_name"], buckets=buckets, registry=None)).labels(self.model_name)

    def show_paths(self, info: dict) -> None:
        """``kvhive_runtime_info`` (device, dtype, ISA level) and ``kvhive_kernel_path_info`` (per op), value 1."""
        runtime = Gauge("kvhive_runtime_info", "Device, dtype and CPU kernel ISA level of this replica.",
                        ["model_name", "device", "dtype", "cpu_isa"], registry=self.registry)
        runtime.labels(self.model_name, info["device"], info["dtype"], info["cpu_isa"] or "").set(1)
        paths = Gauge("kvhive_kernel_path_info", "The implementation each op runs on this replica.",
                      ["model_name", "op", "path"], registry=self.registry)
        for op, path in info["paths"].items():
            paths.labels(self.model_name, op, path).set(1)

    def show_cache_config(self, config: EngineConfig) -> None:
        """``kvhive_cache_config_info``: the KV cache's block size, blocks, prefix caching and dtype, value 1."""
        info = self._add(Gauge("kvhive_cache_config_info", "Configuration of the device KV cache (labels).",
                               ["model_name", "block_size", "num_blocks", "enable_prefix_caching", "cache_dtype"],
                               registry=None))
        cache = config.cache
        info.labels(self.model_name, str(cache.block_size), str(cache.num_blocks),
                    str(cache.enable_prefix_caching), config.dtype).set(1)

    def watch_sessions(self, sessions: Callable[[], SessionStats],
                       pinned_by_tier: Callable[[], dict[str, int]]) -> None:
        """Export session metrics from the registry's stats and the store's pinned blocks per tier."""
        self._add(SessionStatsCollector(sessions, self._engine_stats, pinned_by_tier, self.model_name))

    def watch_responses(self, stats: Callable[[], ResponseStats]) -> None:
        """Export ``/v1/responses`` metrics from the API's stats."""
        self._add(ResponseStatsCollector(stats, self.model_name))

    def track_request(self, max_tokens: int | None = None) -> RequestMetrics:
        """Start timing one request (call at arrival); ``max_tokens``: its limit, observed at the end."""
        return RequestMetrics(self, max_tokens)

    def render(self) -> tuple[bytes, str]:
        """Prometheus text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def finished(self, reason: str):
        """The finished-requests counter of ``reason`` (a reason outside FINISH_REASONS gets its own)."""
        counter = self._by_reason.get(reason)
        return counter if counter is not None else self._requests.labels(self.model_name, reason)


class RequestPhaseHistograms:
    """Where a finished request's time went, from the engine's stamps (vLLM's request intervals):
    queue (queued -> first scheduled), prefill (-> first token), decode (first -> last token),
    inference (first scheduled -> last token), and the mean time per output token after the first."""

    def __init__(self, m: ServerMetrics) -> None:
        self.e2e = m.histogram("kvhive_e2e_request_latency_seconds",
                                "Time from request arrival to its last output (every finish reason).",
                                REQUEST_LATENCY_BUCKETS)
        self.queue = m.histogram("kvhive_request_queue_time_seconds",
                                  "Time from the engine queueing a request to first scheduling it.",
                                  REQUEST_LATENCY_BUCKETS)
        self.prefill = m.histogram("kvhive_request_prefill_time_seconds",
                                    "Time from first scheduling a request to its first token.",
                                    REQUEST_LATENCY_BUCKETS)
        self.decode = m.histogram("kvhive_request_decode_time_seconds",
                                   "Time from a request's first token to its last.", REQUEST_LATENCY_BUCKETS)
        self.inference = m.histogram("kvhive_request_inference_time_seconds",
                                      "Time from first scheduling a request to its last token.",
                                      REQUEST_LATENCY_BUCKETS)
        self.per_token = m.histogram("kvhive_request_time_per_output_token_seconds",
                                      "Decode time over the tokens after the first, per request of two "
                                      "tokens or more.", ITL_BUCKETS)

    def observe(self, queued: float, scheduled: float, first: float, last: float, num_output: int) -> None:
        """Record one request's phases from the engine's stamps (all ``time.monotonic``)."""
        self.queue.observe(max(0.0, scheduled - queued))
        self.prefill.observe(max(0.0, first - scheduled))
        self.decode.observe(max(0.0, last - first))
        self.inference.observe(max(0.0, last - scheduled))
        if num_output > 1:
            self.per_token.observe(max(0.0, last - first) / (num_output - 1))


class RequestMetrics:
    """Timings and counts of one request; ``finish`` records it exactly once, whatever ended it,
    and adds its tokens to its key's usage (``CURRENT_KEY_USAGE`` when it was made)."""

    def __init__(self, metrics: ServerMetrics, max_tokens: int | None = None) -> None:
        self._m = metrics
        self._max_tokens = max_tokens
        self._arrival = time.monotonic()
        self._last_token: float | None = None
        # The engine's stamps: queued and first scheduled, first and last output with tokens.
        self._queued = self._scheduled = self._first_output = self._last_output = None
        self._finished = False
        self._key_usage = CURRENT_KEY_USAGE.get()

    def on_output(self, out: RequestOutput) -> None:
        """Record an engine output: TTFT for the first with tokens, ITL after; keep its stamps."""
        num_new = len(out.new_token_ids)
        if num_new <= 0:
            return
        now = time.monotonic()
        if self._last_token is None:
            self._m.ttft.observe(now - self._arrival)
            self._first_output = out.output_time
        else:
            gap = (now - self._last_token) / num_new
            for _ in range(num_new):
                self._m.itl.observe(gap)
        self._last_token = now
        self._last_output = out.output_time
        self._queued, self._scheduled = out.queued_time, out.scheduled_time

    def finish(self, reason: str, num_prompt_tokens: int, num_output_tokens: int) -> None:
        """Count the finished request (stop / length / abort / error), its tokens and latencies;
        the phase times need a token from the engine. Later calls do nothing."""
        if self._finished:
            return
        self._finished = True
        m = self._m
        m.finished(reason).inc()
        m.prompt_tokens.inc(num_prompt_tokens)
        m.generation_tokens.inc(num_output_tokens)
        if self._key_usage is not None:
            self._key_usage.add_tokens(num_prompt_tokens, num_output_tokens)
        m.phases.e2e.observe(time.monotonic() - self._arrival)
        m.request_prompt_tokens.observe(num_prompt_tokens)
        m.request_generation_tokens.observe(num_output_tokens)
        if self._max_tokens is not None:
            m.max_tokens_param.observe(self._max_tokens)
        if self._scheduled is not None and self._first_output is not None:
            m.phases.observe(self._queued, self._scheduled, self._first_output, self._last_output,
                             num_output_tokens)
