"""An 8-bit KV cache (``--kv-cache-dtype int8|fp8``) in the engine, on the tiny random model.

Within one KV dtype the greedy tokens and their logprobs are the same whether a prompt's KV was
computed in the step, hit in the device prefix cache, restored from the CPU tier, or read from a
disk tier after a restart (attention always reads the quantized values). Tiers written under
another KV dtype are a miss. Speculative decoding over an 8-bit pool gives the plain tokens; a
bfloat16 model runs with one; the forced kernel levels all take the torch path until the C++
kernels read 8-bit rows.
"""

from __future__ import annotations

import logging

import pytest
import torch
from support.engines import make_engine
from support.families import prompt_ids
from support.tiny import tiny_config, tiny_model

from kvhive.config import CacheConfig, EngineConfig, SchedulerConfig, StoreConfig
from kvhive.connector.disagg.params import KVTransferParams
from kvhive.connector.disagg.transfer_config import KVTransferConfig
from kvhive.core.speculative_config import SpeculativeConfig
from kvhive.engine.llm_engine import LLMEngine
from kvhive.model import cpu
from kvhive.model.loader import LoadedModel
from kvhive.request import SamplingParams

QUANTIZED = ("int8", "fp8")
NEW_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
PROMPT = prompt_ids(45, seed=3)            # 11 full 4-token blocks and one token
FLOOD = {f"flood{i}": prompt_ids(40, seed=30 + i) for i in range(5)}
# Same KV dtype, same path: the logprobs agree to float32 rounding of a different batch shape.
SAME_TOL = 1e-4


def _generate(engine: LLMEngine, rid: str, prompt: list[int], sampling: SamplingParams = GREEDY
              ) -> tuple[list[int], list[float], int]:
    """Run one request to the end: its tokens, their logprobs and its cached prompt tokens."""
    engine.add_request(rid, prompt, sampling)
    tokens, logprobs, cached = [], [], -1
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id != rid:
                continue
            assert out.error is None, out.error
            tokens += out.new_token_ids
            logprobs += [lp.logprob for lp in out.logprobs or ()]
            if out.finished:
                cached = out.num_cached_tokens
    return tokens, logprobs, cached


def _assert_same(a: tuple[list[int], list[float], int], b: tuple[list[int], list[float], int], what: str) -> None:
    assert a[0] == b[0], what
    assert max(abs(x - y) for x, y in zip(a[1], b[1], strict=True)) < SAME_TOL, what


def _flood(engine: LLMEngine) -> None:
    """Evict PROMPT's blocks from the device pool (other prompts take every block)."""
    for rid, ids in FLOOD.items():
        _generate(engine, rid, ids, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    engine.connector_worker.wait_for_save()


def _tiered(tokenizer, kv: str, tmp_path, cpu_tier: bool = True, **extra) -> LLMEngine:
    store = StoreConfig(cpu_offload_gb=0.001 if cpu_tier else 0.0, disk_cache_dir=str(tmp_path / "disk"))
    return make_engine(tokenizer, num_blocks=24, kv_cache_dtype=kv, store=store, **extra)


@pytest.mark.parametrize("kv", QUANTIZED)
def test_cached_uncached_offloaded_and_restarted_give_the_same_tokens(tokenizer, tmp_path, kv: str) -> None:
    plain_engine = make_engine(tokenizer, num_blocks=24, kv_cache_dtype=kv, prefix=False)
    try:
        assert plain_engine.runner.kv_cache.dtype == {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[kv]
        plain = _generate(plain_engine, "plain", PROMPT)
    finally:
        plain_engine.close()
    engine = _tiered(tokenizer, kv, tmp_path)
    try:
        cold = _generate(engine, "cold", PROMPT)
        engine.connector_worker.wait_for_save()
        cached = _generate(engine, "cached", PROMPT)
        _flood(engine)
        restored = _generate(engine, "restored", PROMPT)
        tiers = {t.name: t.hit_tokens for t in engine.stats().tiers}
    finally:
        engine.close()
    _assert_same(cold, plain, f"{kv}: cold vs prefix caching off")
    assert cold[2] == 0 and cached[2] == len(PROMPT) - 1
    _assert_same(cached, plain, f"{kv}: device prefix hit")
    assert restored[2] >= 40 and tiers["cpu"] >= 4
    _assert_same(restored, plain, f"{kv}: restored from the CPU tier")
    restarted = _tiered(tokenizer, kv, tmp_path, cpu_tier=False)
    try:
        from_disk = _generate(restarted, "disk", PROMPT)
        assert {t.name: t.hit_tokens for t in restarted.stats().tiers}["disk"] >= 40
    finally:
        restarted.close()
    assert from_disk[2] >= 40
    _assert_same(from_disk, plain, f"{kv}: read from the disk tier after a restart")


@pytest.mark.parametrize(("writer", "reader"), [("auto", "int8"), ("int8", "fp8"), ("fp8", "int8")])
def test_a_disk_tier_written_under_another_kv_dtype_is_a_miss(tokenizer, tmp_path, writer: str, reader: str) -> None:
    """int8 and fp8 rows have the same length: only the key space (its dtype) tells them apart."""
    engine = _tiered(tokenizer, writer, tmp_path, cpu_tier=False)
    try:
        _generate(engine, "write", PROMPT)
        engine.connector_worker.wait_for_save()
        assert engine.connector_scheduler.key_space.dtype == engine.config.kv_dtype
    finally:
        engine.close()
    other = _tiered(tokenizer, reader, tmp_path, cpu_tier=False)
    fresh = make_engine(tokenizer, num_blocks=24, kv_cache_dtype=reader, prefix=False)
    try:
        read = _generate(other, "read", PROMPT)
        expected = _generate(fresh, "fresh", PROMPT)
        assert {t.name: t.hit_tokens for t in other.stats().tiers}["disk"] == 0
    finally:
        other.close()
        fresh.close()
    assert read[2] == 0
    _assert_same(read, expected, f"{reader} over a {writer} disk tier")


def test_speculative_decoding_over_an_int8_pool_gives_the_plain_tokens(tokenizer) -> None:
    prompts = {"a": PROMPT, "b": prompt_ids(23, seed=2) * 2}
    drafts = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3,
                               draft_sizing="per_request")
    outputs, accepted = {}, 0
    for name, speculative in (("plain", None), ("ngram", drafts)):
        engine = make_engine(tokenizer, num_blocks=48, kv_cache_dtype="int8", speculative=speculative)
        try:
            outputs[name] = {rid: _generate(engine, rid, ids) for rid, ids in prompts.items()}
            if speculative is not None:
                accepted = engine.stats().spec_decode.num_accepted_tokens
        finally:
            engine.close()
    assert accepted > 0
    for rid in prompts:
        _assert_same(outputs["ngram"][rid], outputs["plain"][rid], f"speculation, {rid}")


def test_a_bfloat16_model_with_an_int8_pool(tokenizer) -> None:
    """bf16 weights and activations over int8 rows: the pool is int8, tokens mostly the bf16 pool's,
    and a prefix hit changes nothing."""
    runs = {}
    for kv in ("auto", "int8"):
        cfg = tiny_config()
        config = EngineConfig(model_path="tiny", dtype="bfloat16", kv_cache_dtype=kv,
                              cache=CacheConfig(block_size=4, num_blocks=24),
                              scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512))
        engine = LLMEngine(config, loaded=LoadedModel(cfg, tiny_model(cfg, dtype="bfloat16"), "tiny-bf16"),
                           tokenizer=tokenizer)
        try:
            assert engine.runner.kv_cache.dtype == (torch.int8 if kv == "int8" else torch.bfloat16)
            runs[kv] = (_generate(engine, "cold", PROMPT), _generate(engine, "cached", PROMPT))
        finally:
            engine.close()
    cold, cached = runs["int8"]
    assert cached[2] == len(PROMPT) - 1 and cached[0] == cold[0]
    same = sum(a == b for a, b in zip(cold[0], runs["auto"][0][0], strict=True))
    assert same >= NEW_TOKENS // 2


def test_block_bytes_and_pool_follow_the_row_size(tokenizer) -> None:
    """An int8 block is head_dim + 2 bytes a row: (16 + 2) / (16 * 4) of a float32 one here."""
    sizes = {}
    for kv in ("auto", "int8", "fp8_e4m3"):
        engine = make_engine(tokenizer, num_blocks=8, kv_cache_dtype=kv)
        try:
            assert engine.runner.kv_cache[0].nbytes == engine.block_bytes
            sizes[kv] = engine.block_bytes
            assert engine.runtime_info()["kv_cache_dtype"] == engine.config.kv_dtype
        finally:
            engine.close()
    assert sizes["int8"] == sizes["fp8_e4m3"] == sizes["auto"] * 18 // 64


LEVELS = [level for level in ("avx512_bf16", "avx512", "avx2", "portable") if cpu.detect().supports(level)]


@pytest.mark.parametrize("isa", LEVELS)
def test_the_kernels_read_8bit_pools_and_give_the_torch_paths_tokens(tokenizer, isa: str) -> None:
    """At every level the C++ kernels that exist there read the 8-bit pool (no fallback), and the
    tokens are those of the torch backend."""
    outs = {}
    for backend in ("auto", "torch"):
        engine = make_engine(tokenizer, num_blocks=24, kv_cache_dtype="int8", cpu_isa=isa,
                             attention_backend=backend)
        try:
            if backend == "auto":
                assert engine.runner.decode_kernel is not None
                assert (engine.runner.prefill_kernel is None) == (isa == "portable")
                assert "dequantised" not in engine.paths["decode_attention"]
            outs[backend] = _generate(engine, "x", PROMPT)
        finally:
            engine.close()
    _assert_same(outs["auto"], outs["torch"], isa)


@pytest.mark.parametrize("isa", [level for level in ("avx512", "avx2") if cpu.detect().supports(level)])
def test_a_kernel_that_does_not_read_8bit_rows_falls_back_to_torch(tokenizer, caplog, monkeypatch, isa: str) -> None:
    """Forced on any host: kernels whose ``supports_kv`` refuses the format leave both paths to
    torch, logged, and the tokens are those of the torch backend."""
    from kvhive.model.decode_kernel import CpuDecodeKernel
    from kvhive.model.prefill_kernel import CpuPrefillKernel

    for kernel in (CpuDecodeKernel, CpuPrefillKernel):
        monkeypatch.setattr(kernel, "supports_kv", lambda self, kv_dtype: kv_dtype is None)
    outs = {}
    for backend in ("auto", "torch"):
        with caplog.at_level(logging.INFO, logger="kvhive.engine.attention_kernels"):
            engine = make_engine(tokenizer, num_blocks=24, kv_cache_dtype="int8", cpu_isa=isa,
                                 attention_backend=backend)
        try:
            if backend == "auto":
                assert engine.runner.decode_kernel is None and engine.runner.prefill_kernel is None
                assert "dequantised from int8" in engine.paths["decode_attention"]
            outs[backend] = _generate(engine, "x", PROMPT)
        finally:
            engine.close()
    assert "does not read int8 KV pools" in caplog.text
    _assert_same(outs["auto"], outs["torch"], isa)


def _prefill_then_decode(prefill: LLMEngine, decode: LLMEngine, rid: str, prompt: list[int]) -> list[int]:
    """Prefill ``prompt`` on one engine (its first token), push its KV, decode it on the other."""
    port = decode.disagg.worker.receiver.port
    prefill.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                        kv_transfer=KVTransferParams(rid, do_remote_decode=True, decode_endpoint=("127.0.0.1", port)))
    while prefill.has_unfinished():
        prefill.step()
    decode.add_request(rid, prompt, GREEDY, kv_transfer=KVTransferParams(rid, do_remote_prefill=True))
    tokens = []
    while decode.has_unfinished():
        tokens += [t for out in decode.step() if out.request_id == rid for t in out.new_token_ids]
    return tokens


@pytest.mark.parametrize(("sender", "receiver"), [("int8", "int8"), ("fp8", "fp8"), ("int8", "fp8"), ("auto", "int8")])
def test_prefill_to_decode_transfer_only_between_the_same_kv_dtype(tokenizer, sender: str, receiver: str) -> None:
    """The same KV dtype: blocks are received and the tokens are a single engine's; another one
    (int8 and fp8 rows have the same length): the transfer is refused at its hello, the decode
    side recomputes, and the tokens are still its own KV dtype's."""
    single = make_engine(tokenizer, budget=16, kv_cache_dtype=receiver)
    prefill = make_engine(tokenizer, budget=16, kv_cache_dtype=sender,
                          kv_transfer=KVTransferConfig(role="prefill", host="127.0.0.1"))
    decode = make_engine(tokenizer, budget=16, kv_cache_dtype=receiver,
                         kv_transfer=KVTransferConfig(role="decode", host="127.0.0.1", timeout_s=5))
    try:
        want = _generate(single, "single", PROMPT)[0]
        tokens = _prefill_then_decode(prefill, decode, "pd", PROMPT)
        counters = decode.disagg.worker.counters
    finally:
        for engine in (single, prefill, decode):
            engine.close()
    assert tokens == want
    if sender == receiver:
        assert counters.received_blocks == -(-(len(PROMPT) - 1) // 4) and counters.recomputed_blocks == 0
    else:
        assert counters.received_blocks == 0 and counters.recomputed_blocks > 0
