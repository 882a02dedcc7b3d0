"""The engine on a CUDA device with the default model: the same greedy tokens as on CPU, and on CUDA
the same tokens for a cold run, a device-pool hit, a CPU-tier hit (pinned staging, layer by layer),
a disk hit after a restart, a session conversation and a batch. Skipped where CUDA is absent (CI);
run on a GPU machine with ``pytest tests/engine/test_cuda.py``."""

from __future__ import annotations

import pytest
import torch

from kvhive.config import CacheConfig, EngineConfig, SchedulerConfig, StoreConfig
from kvhive.core.model_files import default_model_path
from kvhive.engine.llm_engine import LLMEngine
from kvhive.request import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
TEXT = " ".join(f"Item {i}: the {['red', 'blue', 'green'][i % 3]} box holds {i * 7 % 50} marbles." for i in range(160))


def engine_on(device: str, *, num_blocks: int | None = None, prefix: bool = True,
              store: StoreConfig | None = None) -> LLMEngine:
    config = EngineConfig(model_path=default_model_path(), device=device,
                          cache=CacheConfig(kv_cache_gb=0.25, num_blocks=num_blocks, enable_prefix_caching=prefix),
                          scheduler=SchedulerConfig(max_num_batched_tokens=512),
                          store=store or StoreConfig())
    return LLMEngine(config)


def generate(engine: LLMEngine, prompts: dict[str, list[int]], session_id: str | None = None,
             sampling: SamplingParams = GREEDY) -> dict[str, tuple[list[int], int]]:
    """Run the prompts together to the end: {id: (tokens, cached tokens)}."""
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, sampling, session_id=session_id)
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    cached: dict[str, int] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                cached[out.request_id] = out.num_cached_tokens
    engine.scheduler.kv.pool.check_integrity()
    return {rid: (tokens[rid], cached[rid]) for rid in prompts}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tokenizer = engine_on("cpu", num_blocks=64).tokenizer
    return [tokenizer.encode(TEXT[start:start + 1500]) for start in (0, 1500, 3000, 4500)]


def test_cuda_greedy_tokens_match_cpu(prompts):
    cpu = generate(engine_on("cpu", num_blocks=256), {"a": prompts[0]})["a"][0]
    cuda = generate(engine_on("cuda", num_blocks=256), {"a": prompts[0]})["a"][0]
    assert cuda == cpu


def test_cuda_cache_hits_from_every_tier_give_the_cold_tokens(prompts, tmp_path):
    store = StoreConfig(cpu_offload_gb=0.5, disk_cache_dir=str(tmp_path / "kv"))
    engine = engine_on("cuda", num_blocks=64, store=store)        # 1,024 tokens of device KV
    cold, cached = generate(engine, {"cold": prompts[0]})["cold"]
    assert cached == 0
    hit, cached = generate(engine, {"hit": prompts[0]})["hit"]
    assert hit == cold and cached >= len(prompts[0]) - 16          # device-pool hit
    for i, flood in enumerate(prompts[1:]):                         # evicts prompts[0] from the pool
        generate(engine, {f"flood{i}": flood}, sampling=SamplingParams(max_tokens=2, temperature=0.0))
    engine.connector_worker.wait_for_save()
    tier, cached = generate(engine, {"tier": prompts[0]})["tier"]
    assert tier == cold and cached >= len(prompts[0]) - 16         # CPU-tier hit, copied back to the GPU
    engine.connector_worker.wait_for_save()
    engine.close()

    restarted = engine_on("cuda", num_blocks=64, store=StoreConfig(disk_cache_dir=str(tmp_path / "kv")))
    disk, cached = generate(restarted, {"disk": prompts[0]})["disk"]
    assert disk == cold and cached >= len(prompts[0]) - 16         # disk hit in a new engine
    restarted.close()


def test_cuda_session_conversation_matches_no_caching(prompts):
    held, plain = engine_on("cuda", num_blocks=256), engine_on("cuda", num_blocks=256, prefix=False)
    history_held: list[int] = []
    history_plain: list[int] = []
    for turn, new in enumerate(p[:120] for p in prompts):
        tokens, cached = generate(held, {f"s{turn}": history_held + new}, session_id="conv")[f"s{turn}"]
        expect, _ = generate(plain, {f"p{turn}": history_plain + new})[f"p{turn}"]
        assert tokens == expect, turn
        if turn:
            assert cached == len(history_held) - 1                   # all but the last sampled token
        history_held += new + tokens
        history_plain += new + expect


def test_cuda_batch_matches_one_at_a_time(prompts):
    engine = engine_on("cuda", num_blocks=256, prefix=False)
    alone = {f"r{i}": generate(engine, {f"r{i}": p[:200 + 40 * i]})[f"r{i}"][0] for i, p in enumerate(prompts)}
    together = generate(engine, {f"r{i}": p[:200 + 40 * i] for i, p in enumerate(prompts)})
    assert {rid: tokens for rid, (tokens, _) in together.items()} == alone
