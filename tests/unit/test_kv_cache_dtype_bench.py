"""``bench/kv_cache_dtype_bench.py``: its byte and floor arithmetic, its ratios and its rendered section."""

from __future__ import annotations

import pytest
from kv_cache_dtype_bench import (
    floor_ms,
    kv_bytes,
    model_dtype,
    paired_ratios,
    render,
    stream_gaps_ms,
    summary,
    transfer_blocks,
)


def test_kv_bytes_follow_the_row_format() -> None:
    rows = 30 * 2 * 3                       # SmolLM2-135M: layers x (K, V) x KV heads
    assert kv_bytes(1, rows, 64, "float32") == rows * 256
    assert kv_bytes(1, rows, 64, "bfloat16") == rows * 128
    assert kv_bytes(10, rows, 64, "int8") == kv_bytes(10, rows, 64, "fp8") == 10 * rows * 66


def test_floor_gaps_blocks_and_model_dtype() -> None:
    assert floor_ms(60_000_000, 40_000_000, 50.0) == 2.0
    assert stream_gaps_ms([0.5, 0.51, 0.53]) == pytest.approx([10.0, 20.0])
    assert stream_gaps_ms([0.5]) == []
    assert transfer_blocks(1000) == 63 and transfer_blocks(17) == 1 and transfer_blocks(18) == 2
    assert [model_dtype(kv) for kv in ("float32", "bfloat16", "int8", "fp8")] == [
        "float32", "bfloat16", "float32", "float32"]


def test_paired_ratios_take_the_median_over_rounds_with_both_servers() -> None:
    rounds = [{"fp8": {"kvhive": {"ms_per_token": 30.0}, "vllm": {"ms_per_token": 20.0}}},
              {"fp8": {"kvhive": {"ms_per_token": 40.0}, "vllm": {"ms_per_token": 20.0}}},
              {"fp8": {"kvhive": {"ms_per_token": 10.0}, "vllm": {"ms_per_token": None}}}]
    assert paired_ratios(rounds) == {"fp8": 1.75}
    assert paired_ratios([{"fp8": {"kvhive": {"ms_per_token": 30.0}}}]) == {"fp8": None}


def _record() -> dict:
    def kv_row(held: int, doc_bytes: int) -> dict:
        return {"working_set": {"docs_held": held, "hits_on_reask": held, "doc_bytes": doc_bytes},
                "restart": {"restart_hit_s": 0.05, "warm_hit_s": 0.02, "cold_s": 1.0, "disk_bytes": doc_bytes + 99},
                "pd_transfer": {"bytes": doc_bytes, "blocks": 63, "measured_sent_bytes": doc_bytes}}

    decode = {"context": 16384, "ms_per_token": 50.0, "floor_ms": 20.0, "ratio_to_floor": 2.5,
              "weight_bytes": 538_000_000, "kv_bytes": 190_000_000}
    record = {"model": "m", "threads": 2, "smoke": False, "long_model": "hf",
              "config": {"cpu_tier_mb": 192, "docs": 22, "doc_tokens": 1000, "repeat": 5},
              "bandwidth": {"read_gb_s": 50.0},
              "per_kv": {"bfloat16": kv_row(8, 23_000_000), "int8": kv_row(17, 12_000_000),
                         "fp8": kv_row(15, 12_000_000)},
              "decode": {"default": {"int8": decode}, "long": {"int8": decode}},
              "served_decode": {"prompt_tokens": 16320, "max_tokens": 64, "peer": "vLLM",
                                "rounds": [{"fp8": {"kvhive": {"requests": [{"ttft_s": 90.0}], "ms_per_token": 40.0},
                                                    "vllm": {"requests": [{"ttft_s": 60.0}], "ms_per_token": 20.0}}}],
                                "kvhive_over_vllm": {"fp8": 2.0}}}
    record["summary"] = summary(record)
    return record


def test_summary_compares_documents_and_bytes_with_bfloat16() -> None:
    s = _record()["summary"]
    assert s["int8"]["docs_held_vs_bf16"] == 17 / 8 and s["bfloat16"]["docs_held_vs_bf16"] == 1.0
    assert s["fp8"]["bytes_vs_bf16"] == 12 / 23


def test_render_states_the_target_and_every_figure() -> None:
    text = "\n".join(render("kv_cache_dtype_bench.json", _record()))
    assert "int8 2.12x (met); fp8 1.88x (not met)" in text
    assert "| int8 | 12.0 MB | 17 (2.12x) | 17 (2.12x) | 50 / 20 / 1000 | 12.0 MB |" in text
    assert "| HF checkpoint, 16,384 | int8 | 50.0 | 20.0 | 2.50x | 538 + 190 |" in text
    assert "| 1 | fp8 | vllm | 60.0 | 20.0 |" in text and "fp8 2.00x" in text
    assert "smoke" not in text
