"""vLLM's metric names for kvhive's metrics (``kvhive serve --metrics-compat vllm``).

Dashboards, autoscalers and endpoint pickers written for vLLM read ``vllm:*`` names (llm-d's
scorers read ``vllm:num_requests_waiting`` and ``vllm:kv_cache_usage_perc``). With the option, each
kvhive metric whose meaning matches a vLLM v1 metric is exported a second time under vLLM's name and
type, with vLLM's labels (``model_name``, ``engine``). Both names come from one collection, so a
scrape shows them equal. ``docs/metrics.md`` has the table and says where the meanings differ.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from kvhive.config import METRICS_COMPAT

# kvhive runs one engine per process; vLLM labels its first engine "0".
ENGINE_INDEX = "0"


class VllmName(NamedTuple):
    """vLLM's name for a kvhive metric, and its names for labels that differ (kvhive -> vLLM)."""

    name: str
    labels: tuple[tuple[str, str], ...] = ()


# kvhive family name (counters without ``_total``) -> vLLM's; the type is the same on both sides.
VLLM_NAMES: dict[str, VllmName] = {
    "kvhive_num_requests_running": VllmName("vllm:num_requests_running"),
    "kvhive_num_requests_waiting": VllmName("vllm:num_requests_waiting"),
    "kvhive_kv_cache_usage_perc": VllmName("vllm:kv_cache_usage_perc"),
    "kvhive_prefix_cache_queries": VllmName("vllm:prefix_cache_queries"),
    "kvhive_prefix_cache_hits": VllmName("vllm:prefix_cache_hits"),
    "kvhive_store_prefix_cache_queries": VllmName("vllm:external_prefix_cache_queries"),
    "kvhive_store_prefix_cache_hits": VllmName("vllm:external_prefix_cache_hits"),
    "kvhive_num_preemptions": VllmName("vllm:num_preemptions"),
    "kvhive_prompt_tokens": VllmName("vllm:prompt_tokens"),
    "kvhive_generation_tokens": VllmName("vllm:generation_tokens"),
    "kvhive_request_finished": VllmName("vllm:request_success"),
    "kvhive_time_to_first_token_seconds": VllmName("vllm:time_to_first_token_seconds"),
    "kvhive_inter_token_latency_seconds": VllmName("vllm:inter_token_latency_seconds"),
    "kvhive_e2e_request_latency_seconds": VllmName("vllm:e2e_request_latency_seconds"),
    "kvhive_request_queue_time_seconds": VllmName("vllm:request_queue_time_seconds"),
    "kvhive_request_prefill_time_seconds": VllmName("vllm:request_prefill_time_seconds"),
    "kvhive_request_decode_time_seconds": VllmName("vllm:request_decode_time_seconds"),
    "kvhive_request_inference_time_seconds": VllmName("vllm:request_inference_time_seconds"),
    "kvhive_request_time_per_output_token_seconds": VllmName("vllm:request_time_per_output_token_seconds"),
    "kvhive_request_prompt_tokens": VllmName("vllm:request_prompt_tokens"),
    "kvhive_request_generation_tokens": VllmName("vllm:request_generation_tokens"),
    "kvhive_request_params_max_tokens": VllmName("vllm:request_params_max_tokens"),
    "kvhive_cache_config_info": VllmName("vllm:cache_config_info", (("num_blocks", "num_gpu_blocks"),)),
    "kvhive_spec_decode_num_drafts": VllmName("vllm:spec_decode_num_drafts"),
    "kvhive_spec_decode_num_draft_tokens": VllmName("vllm:spec_decode_num_draft_tokens"),
    "kvhive_spec_decode_num_accepted_tokens": VllmName("vllm:spec_decode_num_accepted_tokens"),
    "kvhive_spec_decode_num_accepted_tokens_per_pos": VllmName("vllm:spec_decode_num_accepted_tokens_per_pos"),
}


def check_metrics_compat(compat: str) -> None:
    """ValueError naming ``--metrics-compat`` unless ``compat`` is one of METRICS_COMPAT."""
    if compat not in METRICS_COMPAT:
        raise ValueError(f"--metrics-compat must be one of {', '.join(METRICS_COMPAT)}, got {compat!r}")


def with_vllm_names(collector: Collector, compat: str) -> Collector:
    """``collector`` itself, or with ``compat == "vllm"`` a collector that also yields vLLM's names."""
    return VllmAliases(collector) if compat == "vllm" else collector


class VllmAliases(Collector):
    """Yields what ``inner`` collects and, after each family vLLM has, that family under vLLM's name."""

    def __init__(self, inner: Collector) -> None:
        self._inner = inner

    def collect(self) -> Iterator[Metric]:
        """Each family of one collection of ``inner``, followed by its vLLM alias where there is one."""
        for family in self._inner.collect():
            yield family
            alias = VLLM_NAMES.get(family.name)
            if alias is not None:
                yield renamed(family, alias)


def renamed(family: Metric, alias: VllmName) -> Metric:
    """``family``'s samples under ``alias``: labels ``model_name``, ``engine``, then the family's own
    (renamed where vLLM names them differently); prometheus_client's ``_created`` samples left out."""
    out = Metric(alias.name, family.documentation, family.type)
    relabel = dict(alias.labels)
    for sample in family.samples:
        suffix = sample.name[len(family.name):]
        if suffix == "_created":
            continue
        labels = {"model_name": sample.labels.get("model_name", ""), "engine": ENGINE_INDEX}
        labels.update((relabel.get(k, k), v) for k, v in sample.labels.items() if k != "model_name")
        out.samples.append(sample._replace(name=alias.name + suffix, labels=labels))
    return out
