"""Metric families of disaggregated serving's KV transfers, labelled by the instance's role."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from kvhive.connector.disagg.transfer_stats import TRANSFER_BUCKETS_S, KVTransferStats


def kv_transfer_metrics(model_labels: list[str], t: KVTransferStats) -> Iterator[Metric]:
    """Bytes and blocks sent and received, blocks skipped, recomputed or taken from the shared tier,
    failed transfers, and the transfer time histogram (a layer frame sent; a remote load waited)."""
    labels, values = model_labels + [t.role], ["model_name", "role"]
    for name, doc, rows in (
        ("kvhive_kv_transfer_bytes", "KV bytes moved replica to replica, by direction.",
         (("sent", t.sent_bytes), ("received", t.received_bytes))),
        ("kvhive_kv_transfer_blocks", "KV blocks moved replica to replica (every layer), by direction.",
         (("sent", t.sent_blocks), ("received", t.received_blocks))),
    ):
        family = CounterMetricFamily(name, doc, labels=values + ["direction"])
        for direction, value in rows:
            family.add_metric(labels + [direction], value)
        yield family
    for name, doc, value in (
        ("kvhive_kv_transfer_skipped_blocks", "Blocks not sent: the decode instance held them.", t.skipped_blocks),
        ("kvhive_kv_transfer_send_failures", "Transfers the prefill side could not deliver.", t.send_failures),
        ("kvhive_kv_transfer_failed", "Incoming transfers that broke (refused, corrupt, truncated, silent).",
         t.failed_transfers),
        ("kvhive_kv_transfer_fallback_blocks", "Blocks a transfer lacked, taken from the shared tier.",
         t.fallback_blocks),
        ("kvhive_kv_transfer_recomputed_blocks", "Blocks a transfer lacked, recomputed by the decode side.",
         t.recomputed_blocks),
    ):
        family = CounterMetricFamily(name, doc, labels=values)
        family.add_metric(labels, value)
        yield family
    histogram = HistogramMetricFamily("kvhive_kv_transfer_seconds", "Time of a layer frame sent (prefill) or "
                                      "a remote load waited for (decode).", labels=values)
    cumulative, buckets = 0, []
    for bound, count in zip([*map(str, TRANSFER_BUCKETS_S), "+Inf"], t.time_buckets, strict=True):
        cumulative += count
        buckets.append((bound, cumulative))
    histogram.add_metric(labels, buckets, t.time_sum_s)
    yield histogram
