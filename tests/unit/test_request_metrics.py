"""Per-request latency accounting (ServerMetrics / RequestMetrics) and the vLLM names beside it.

The engine's stamps on each output (queued, first scheduled, produced) are given here, so the
phase times are exact; the server's own clock only shows in counts (TTFT, ITL, end-to-end).
"""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvhive.engine.llm_engine import RequestOutput
from kvhive.engine.stats import EngineStats
from kvhive.request import FinishReason
from kvhive.server.metrics import ServerMetrics, token_buckets

MODEL = "m"


def engine_stats() -> EngineStats:
    return EngineStats(num_running=1, num_waiting=2, kv_usage=0.25, prefix_cache_queries_tokens=40,
                       prefix_cache_hits_tokens=16, num_preemptions=3, num_blocks=64, block_size=16)


def output(n: int, t: float, scheduled: float | None = 10.5, finished: bool = False) -> RequestOutput:
    """An engine output with ``n`` new tokens produced at engine time ``t`` (queued at 10.0)."""
    return RequestOutput(request_id="r", new_token_ids=[7] * n, finished=finished,
                         finish_reason=FinishReason.LENGTH if finished else None, num_prompt_tokens=5,
                         num_cached_tokens=0, num_output_tokens=0, queued_time=10.0,
                         scheduled_time=scheduled, output_time=t)


def families(metrics: ServerMetrics) -> dict[str, dict]:
    """{family name: {sample name + sorted labels: value}} of one scrape."""
    out = {}
    for family in text_string_to_metric_families(metrics.render()[0].decode()):
        out[family.name] = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}
    return out


def value(scrape: dict, family: str, sample: str, **labels: str) -> float:
    """One sample of a scrape; labels besides model_name (and engine for vllm: names) as given."""
    base = {"model_name": MODEL, **({"engine": "0"} if family.startswith("vllm:") else {}), **labels}
    return scrape[family][(sample, tuple(sorted(base.items())))]


def test_a_finished_request_records_its_phases_from_the_engine_stamps() -> None:
    metrics = ServerMetrics(engine_stats, MODEL, max_model_len=100)
    tracker = metrics.track_request(max_tokens=3)
    for out in (output(1, 11.0), output(1, 11.5), output(1, 12.5, finished=True)):
        tracker.on_output(out)
    tracker.finish("length", 5, 3)
    s = families(metrics)
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds", "time_to_first_token_seconds"):
        assert value(s, f"kvhive_{name}", f"kvhive_{name}_count") == 1, name
    assert value(s, "kvhive_request_queue_time_seconds", "kvhive_request_queue_time_seconds_sum") == 0.5
    assert value(s, "kvhive_request_prefill_time_seconds", "kvhive_request_prefill_time_seconds_sum") == 0.5
    assert value(s, "kvhive_request_decode_time_seconds", "kvhive_request_decode_time_seconds_sum") == 1.5
    assert value(s, "kvhive_request_inference_time_seconds", "kvhive_request_inference_time_seconds_sum") == 2.0
    per_token = "kvhive_request_time_per_output_token_seconds"
    assert value(s, per_token, per_token + "_sum") == 0.75              # 1.5 s over the 2 tokens after the first
    assert value(s, "kvhive_inter_token_latency_seconds", "kvhive_inter_token_latency_seconds_count") == 2
    assert value(s, "kvhive_request_finished", "kvhive_request_finished_total", finished_reason="length") == 1
    assert value(s, "kvhive_request_finished", "kvhive_request_finished_total", finished_reason="stop") == 0
    assert value(s, "kvhive_request_prompt_tokens", "kvhive_request_prompt_tokens_sum") == 5
    assert value(s, "kvhive_request_generation_tokens", "kvhive_request_generation_tokens_bucket", le="2.0") == 0
    assert value(s, "kvhive_request_generation_tokens", "kvhive_request_generation_tokens_bucket", le="5.0") == 1
    assert value(s, "kvhive_request_params_max_tokens", "kvhive_request_params_max_tokens_sum") == 3


def test_a_request_is_counted_once_whatever_ends_it() -> None:
    metrics = ServerMetrics(engine_stats, MODEL)
    tracker = metrics.track_request()
    tracker.on_output(output(1, 11.0))
    tracker.finish("stop", 5, 1)
    tracker.finish("abort", 5, 1)             # the stream's cleanup after a stop string: no second count
    s = families(metrics)
    assert value(s, "kvhive_request_finished", "kvhive_request_finished_total", finished_reason="stop") == 1
    assert value(s, "kvhive_request_finished", "kvhive_request_finished_total", finished_reason="abort") == 0
    assert value(s, "kvhive_e2e_request_latency_seconds", "kvhive_e2e_request_latency_seconds_count") == 1
    # One token: no time per output token after the first.
    per_token = "kvhive_request_time_per_output_token_seconds"
    assert value(s, per_token, per_token + "_count") == 0


def test_requests_that_end_without_a_token_count_but_have_no_phases() -> None:
    """Aborted before its first token, or failed in the engine: e2e and the finish reason are
    recorded; queue, prefill and decode need the engine's stamps on a token."""
    metrics = ServerMetrics(engine_stats, MODEL)
    metrics.track_request().finish("abort", 5, 0)
    failed = metrics.track_request()
    failed.on_output(output(0, 11.0))         # a prefill chunk's output: no token, no stamp kept
    failed.finish("error", 5, 0)
    s = families(metrics)
    assert value(s, "kvhive_e2e_request_latency_seconds", "kvhive_e2e_request_latency_seconds_count") == 2
    assert value(s, "kvhive_request_finished", "kvhive_request_finished_total", finished_reason="error") == 1
    assert value(s, "kvhive_request_queue_time_seconds", "kvhive_request_queue_time_seconds_count") == 0
    assert value(s, "kvhive_time_to_first_token_seconds", "kvhive_time_to_first_token_seconds_count") == 0


def test_a_request_failing_mid_way_keeps_the_phases_it_reached() -> None:
    metrics = ServerMetrics(engine_stats, MODEL)
    tracker = metrics.track_request()
    tracker.on_output(output(1, 11.0))
    tracker.on_output(output(1, 13.0))
    tracker.finish("error", 5, 2)
    s = families(metrics)
    assert value(s, "kvhive_request_decode_time_seconds", "kvhive_request_decode_time_seconds_sum") == 2.0
    assert value(s, "kvhive_request_finished", "kvhive_request_finished_total", finished_reason="error") == 1


def test_vllm_names_repeat_the_kvhive_values_with_vllm_labels() -> None:
    metrics = ServerMetrics(engine_stats, MODEL, compat="vllm")
    tracker = metrics.track_request(max_tokens=2)
    tracker.on_output(output(1, 11.0))
    tracker.on_output(output(1, 11.2, finished=True))
    tracker.finish("length", 5, 2)
    s = families(metrics)
    assert value(s, "vllm:num_requests_waiting", "vllm:num_requests_waiting") == 2
    assert value(s, "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc") == 0.25
    assert value(s, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == 16
    assert value(s, "vllm:request_success", "vllm:request_success_total", finished_reason="length") == 1
    assert value(s, "vllm:request_queue_time_seconds", "vllm:request_queue_time_seconds_sum") == 0.5
    assert value(s, "vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count") == 1
    for name, samples in s.items():
        if name.startswith("vllm:"):
            kvhive = s["kvhive_" + name.removeprefix("vllm:")] if "kvhive_" + name[5:] in s else None
            if kvhive is not None:
                assert sorted(samples.values()) == sorted(v for (n, _), v in kvhive.items()
                                                          if not n.endswith("_created")), name


def test_without_compat_no_vllm_name_is_exported() -> None:
    metrics = ServerMetrics(engine_stats, MODEL)
    metrics.track_request().finish("stop", 1, 1)
    assert not [name for name in families(metrics) if name.startswith("vllm:")]
    assert b"vllm:" not in metrics.render()[0]


def test_an_unknown_compat_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="--metrics-compat must be one of none, vllm, got 'prometheus'"):
        ServerMetrics(engine_stats, MODEL, compat="prometheus")


def test_token_buckets_follow_1_2_5_up_to_the_context() -> None:
    assert token_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert token_buckets(4096)[-1] == 2000
