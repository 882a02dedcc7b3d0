"""EngineConfig.resolved: the model-dependent values (pool size, context length) fixed in one place."""

from __future__ import annotations

import pytest

from kvhive.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

MODEL = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=8, max_position_embeddings=512)


def test_the_pool_size_comes_from_kv_cache_gb_unless_num_blocks_is_given():
    config = EngineConfig(model_path="m", cache=CacheConfig(block_size=16, kv_cache_gb=0.01))
    block_bytes = config.kv_bytes_per_block(MODEL)
    assert block_bytes == 2 * 2 * 2 * 8 * 16 * 4                # K and V, layers, kv heads, dim, tokens, fp32
    assert config.resolved(MODEL).cache.num_blocks == int(0.01 * 2**30) // block_bytes
    fixed = EngineConfig(model_path="m", cache=CacheConfig(num_blocks=7))
    assert fixed.resolved(MODEL).cache.num_blocks == 7


def test_half_precision_blocks_take_half_the_bytes():
    fp32, bf16 = EngineConfig(model_path="m"), EngineConfig(model_path="m", dtype="bfloat16")
    assert fp32.kv_bytes_per_block(MODEL) == 2 * bf16.kv_bytes_per_block(MODEL)


def test_a_cache_too_small_for_two_blocks_is_refused():
    config = EngineConfig(model_path="m", cache=CacheConfig(kv_cache_gb=1e-9))
    with pytest.raises(ValueError, match="kv-cache-gb"):
        config.resolved(MODEL)


def test_the_context_is_capped_at_the_model_s_and_a_shorter_one_kept():
    long = EngineConfig(model_path="m", scheduler=SchedulerConfig(max_model_len=8192))
    assert long.resolved(MODEL).scheduler.max_model_len == 512
    short = EngineConfig(model_path="m", scheduler=SchedulerConfig(max_model_len=100))
    assert short.resolved(MODEL).scheduler == short.scheduler


def test_a_context_the_user_asked_for_past_the_model_s_is_refused_not_capped():
    asked = EngineConfig(model_path="m", scheduler=SchedulerConfig(max_model_len=8192, max_model_len_given=True))
    with pytest.raises(ValueError, match="--max-model-len 8192 is more than the model's context"):
        asked.resolved(MODEL)
    within = EngineConfig(model_path="m", scheduler=SchedulerConfig(max_model_len=512, max_model_len_given=True))
    assert within.resolved(MODEL).scheduler.max_model_len == 512


def test_store_tiers_handed_to_the_engine_need_prefix_caching():
    config = EngineConfig(model_path="m", cache=CacheConfig(enable_prefix_caching=False))
    assert config.resolved(MODEL).cache.num_blocks is not None
    with pytest.raises(ValueError, match="prefix caching"):
        config.resolved(MODEL, external_store=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_block_bytes_match_the_runner_s_pool(dtype):
    from kvhive.engine.runner import ModelRunner

    config = EngineConfig(model_path="m", dtype=dtype)
    assert config.kv_bytes_per_block(MODEL) == ModelRunner.kv_bytes_per_block(MODEL, 16, dtype)


def test_a_compute_step_budget_gets_the_model_s_attention_context():
    compute = EngineConfig(model_path="m", scheduler=SchedulerConfig(step_budget="compute"))
    assert compute.resolved(MODEL).scheduler.attention_context == MODEL.attention_balance_context
    assert EngineConfig(model_path="m").resolved(MODEL).scheduler.attention_context is None
    with pytest.raises(ValueError, match="step-budget"):
        SchedulerConfig(step_budget="flops")


def test_the_attention_balance_context_is_where_attention_costs_what_the_projections_cost():
    smollm2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                          num_kv_heads=3, head_dim=64)
    # per token and layer: q, k, v, o and the MLP 3,538,944 multiply-adds; attention 2 x 9 x 64 per key
    assert smollm2.attention_balance_context == 3072


def test_kv_budgets_past_the_machine_s_memory_are_refused_naming_the_flags(monkeypatch, tmp_path):
    from kvhive import config as config_module
    from kvhive.config import StoreConfig
    from kvhive.core import host_resources
    from kvhive.core.host_resources import kv_memory_problem, usable_memory_bytes

    gib = 2**30
    assert kv_memory_problem([("--cpu-offload-gb 8", 8.0)], 10 * gib) is None            # within 90%
    problem = kv_memory_problem([("--kv-cache-gb 2", 2.0), ("--cpu-offload-gb 8", 8.0)], 10 * gib)
    assert problem.startswith("--kv-cache-gb 2 and --cpu-offload-gb 8 ask for 10 GiB") and "9.0 GiB" in problem
    assert kv_memory_problem([("--cpu-offload-gb 1e9", 1e9)], None) is None                # memory unknown
    # A cgroup's limit under the machine's memory is the one that counts ("max": no limit).
    limit, unlimited = tmp_path / "memory.max", tmp_path / "v1.limit"
    limit.write_text(f"{4 * gib}\n")
    unlimited.write_text("max\n")
    monkeypatch.setattr(host_resources, "_CGROUP_LIMITS", (str(unlimited), str(limit), str(tmp_path / "absent")))
    assert usable_memory_bytes() == min(4 * gib, host_resources.os.sysconf("SC_PHYS_PAGES")
                                        * host_resources.os.sysconf("SC_PAGE_SIZE"))
    monkeypatch.setattr(config_module, "usable_memory_bytes", lambda: 4 * gib)
    with pytest.raises(ValueError, match="--cpu-offload-gb 5 asks for 5"):
        EngineConfig(model_path="m", device="cuda", store=StoreConfig(cpu_offload_gb=5))   # a GPU pool is not counted
    with pytest.raises(ValueError, match="--kv-cache-gb 3 and --cpu-offload-gb 1 ask for 4"):
        EngineConfig(model_path="m", cache=CacheConfig(kv_cache_gb=3), store=StoreConfig(cpu_offload_gb=1))
    assert EngineConfig(model_path="m", cache=CacheConfig(kv_cache_gb=2), store=StoreConfig(cpu_offload_gb=1))
