"""Engines on the tiny random model behind the default model's tokenizer, and loops that drive them
to the end in the test's own process."""

from __future__ import annotations

from support.tiny import tiny_config, tiny_model

from kvhive.config import CacheConfig, EngineConfig, SchedulerConfig, StoreConfig
from kvhive.engine.llm_engine import LLMEngine, RequestOutput
from kvhive.model.loader import LoadedModel
from kvhive.request import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def make_engine(tokenizer, *, num_blocks=64, block_size=4, prefix=True, budget=64, max_seqs=4,
                vocab_size=256, step_budget="tokens", **extra) -> LLMEngine:
    """An engine on the tiny random model (block geometry and budgets as given) with ``tokenizer``;
    ``vocab_size``: the model's logits width (the tokenizer's, for tests that sample its long tokens)."""
    cfg = tiny_config(max_position_embeddings=512, vocab_size=vocab_size)
    loaded = LoadedModel(cfg, tiny_model(cfg), "tiny-engine-test")
    config = EngineConfig(
        model_path="tiny", cache=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                             enable_prefix_caching=prefix),
        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                  max_model_len=512, step_budget=step_budget), **extra)
    return LLMEngine(config, loaded=loaded, tokenizer=tokenizer)


def make_engine_with_cpu_tier(tokenizer, tier_blocks: int, **kwargs) -> LLMEngine:
    """``make_engine`` with a CPU memory tier of ``tier_blocks`` blocks."""
    probe = make_engine(tokenizer, **kwargs)
    block_bytes = probe.block_bytes
    probe.close()
    return make_engine(tokenizer, store=StoreConfig(cpu_offload_gb=tier_blocks * block_bytes / 2**30), **kwargs)


def run(engine: LLMEngine, prompts: dict[str, list[int]], sampling=GREEDY, stagger=False):
    """Generate all prompts; returns {id: (tokens, cached_tokens)}. With stagger, each request
    is added one step after the previous one."""
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    cached: dict[str, int] = {}
    pending = list(prompts.items())
    if not stagger:
        for rid, ids in pending:
            engine.add_request(rid, ids, sampling)
        pending = []
    for _ in range(2000):
        if pending:
            rid, ids = pending.pop(0)
            engine.add_request(rid, ids, sampling)
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                cached[out.request_id] = out.num_cached_tokens
        if not pending and not engine.has_unfinished():
            break
    return {rid: (tokens[rid], cached.get(rid)) for rid in prompts}


def turn(engine, rid, prompt, session_id=None, end=False, sampling=GREEDY):
    """Run one request to the end; returns (output tokens, cached tokens, session hashes)."""
    engine.add_request(rid, prompt, sampling, session_id=session_id, end_session=end)
    tokens, cached, hashes = [], None, None
    for _ in range(2000):
        for out in engine.step():
            tokens += out.new_token_ids
            if out.finished:
                cached, hashes = out.num_cached_tokens, out.session_block_hashes
        if not engine.has_unfinished():
            break
    engine.scheduler.kv.pool.check_integrity()
    return tokens, cached, hashes


def run_engine(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]
               ) -> dict[str, list[RequestOutput]]:
    """Generate every request to the end; returns each request's outputs in order."""
    for rid, (prompt, sampling) in requests.items():
        engine.add_request(rid, prompt, sampling)
    outputs: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return outputs
