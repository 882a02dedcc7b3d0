"""Gemma's window layers in a pool of their own: blocks released while a request runs, prefix hits
shortened to where the window parts are kept, sessions, and the tiers (objects hold every layer, as
a one-pool engine writes them).

Tiny random Gemma 2 (window and global layers alternate) and Gemma 3 (five window layers to one
global) checkpoints with an 8-key window and 16-token blocks, against transformers' greedy tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import pytest
import torch
from support.engines import run
from support.families import hf_model, path_in, prompt_ids, save_hf

from kvhive.config import CacheConfig, EngineConfig, SchedulerConfig, StoreConfig
from kvhive.core.blocks import ExtraKeys, hash_blocks
from kvhive.engine.llm_engine import LLMEngine
from kvhive.engine.runner import ModelRunner
from kvhive.engine.step import ScheduledSeq, StepPlan
from kvhive.kv.pool import NULL_BLOCK_ID
from kvhive.kv.window_group import WindowLayout
from kvhive.model import cpu
from kvhive.model.loader import LoadedModel, load_model
from kvhive.request import Request, SamplingParams

pytest.importorskip("transformers")

BLOCK = 16
NEW_TOKENS = 32
GEMMAS = ("gemma2", "gemma3_text")
PROMPT = prompt_ids(70, seed=5)          # four full blocks and a partial one; the window is 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
LOGPROB_TOL = 1e-4          # float32: each sampled token's logprob against transformers'


class Greedy(NamedTuple):
    """Greedy tokens and each one's logprob (the logprobs tell wrong KV apart where tokens repeat)."""

    tokens: list[int]
    logprobs: list[float]

    def matches(self, other: Greedy) -> bool:
        """Same tokens, logprobs within LOGPROB_TOL."""
        return self.tokens == other.tokens and max(
            abs(a - b) for a, b in zip(self.logprobs, other.logprobs, strict=True)) < LOGPROB_TOL


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[torch.nn.Module, str, Greedy]]:
    """Per family: the transformers model, its HF directory and its greedy tokens for PROMPT."""
    root = tmp_path_factory.mktemp("window_kv")
    out = {}
    for family in GEMMAS:
        model = hf_model(family)
        out[family] = (model, save_hf(model, path_in(root, family)), _hf_greedy(model, PROMPT))
    return out


def _hf_greedy(model: torch.nn.Module, prompt: list[int]) -> Greedy:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    return Greedy(tokens, [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.scores, tokens, strict=True)])


def _generate(engine: LLMEngine, rid: str, prompt: list[int], session_id: str | None = None) -> tuple[Greedy, int]:
    """Run one request to the end: its greedy tokens and logprobs, and its cached tokens."""
    out, cached, _ = _generate_watching_window(engine, rid, prompt, session_id)
    return out, cached


def _run_checking(engine: LLMEngine, rid: str, prompt: list[int], check: Callable[[Request], None],
                  session_id: str | None = None) -> tuple[Greedy, int]:
    """Run one request to the end, calling ``check`` with it after every step it is still running
    after: its greedy tokens and logprobs, and its cached tokens."""
    engine.add_request(rid, prompt, GREEDY, session_id=session_id)
    tokens, logprobs, cached = [], [], -1
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            logprobs += [lp.logprob for lp in out.logprobs or ()]
            if out.finished:
                cached = out.num_cached_tokens
        request = engine.scheduler.get_request(rid)
        if request is not None:
            check(request)
    return Greedy(tokens, logprobs), cached


def _engine(loaded: LoadedModel, tokenizer, num_blocks: int = 24, store: StoreConfig | None = None,
            chunk: int = 16, **extra) -> LLMEngine:
    config = EngineConfig(model_path="tiny", cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks),
                          scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=chunk, max_model_len=512),
                          store=store or StoreConfig(), **extra)
    return LLMEngine(config, loaded=loaded, tokenizer=tokenizer)


def _evict_window_parts(engine: LLMEngine, hashes: list[bytes]) -> None:
    """Evict these blocks' window parts from the window pool (as other requests' allocations would)."""
    pool = engine.scheduler.kv.window.pool
    kept = [b for h, b in pool.cached.items() if h not in hashes and b.ref_cnt == 0]
    pool.touch(kept)
    taken = pool.get_new_blocks(pool.num_free_blocks)
    pool.free_blocks(taken + kept)
    assert not any(h in pool.cached for h in hashes)


@pytest.mark.parametrize("family", GEMMAS)
def test_window_blocks_return_to_their_pool_while_the_request_runs(saved, tokenizer, family: str) -> None:
    _, path, reference = saved[family]
    engine = _engine(load_model(path), tokenizer)
    try:
        kv = engine.scheduler.kv
        assert engine.runner.window is not None and "window_kv" in engine.paths
        seen_released = False

        def check(request: Request) -> None:
            nonlocal seen_released
            table, window = kv.get_block_table(request), kv.get_window_table(request)
            released = [i for i, b in enumerate(window) if b == NULL_BLOCK_ID]
            first = kv.window.first_needed(request.num_computed_tokens)
            assert released == list(range(first))            # everything before the window, nothing after
            assert kv.window.num_held("r") <= 3 < len(table) or len(table) <= 3
            if released:
                seen_released = True
                free_ids = {b.block_id for b in kv.window.pool.free_queue}
                assert kv.window.stats().num_used == kv.window.num_held("r")
                assert free_ids.isdisjoint(b for b in window if b != NULL_BLOCK_ID)
            kv.window.pool.check_integrity()

        out, _ = _run_checking(engine, "r", PROMPT, check)
        assert seen_released and out.matches(reference)
        assert kv.window.stats().num_used == 0 and kv.pool.stats().num_used == 0
    finally:
        engine.close()


@contextmanager
def _after_cold_run(saved, tokenizer, family: str) -> Iterator[tuple[LLMEngine, Greedy, list[bytes]]]:
    """An engine that has run PROMPT once (checked against transformers), the reference and
    PROMPT's block hashes; every one of its blocks is cached."""
    _, path, reference = saved[family]
    engine = _engine(load_model(path), tokenizer)
    try:
        cold, cached = _generate(engine, "cold", PROMPT)
        assert cold.matches(reference) and cached == 0
        chain = _chain(engine)
        assert all(h in engine.scheduler.kv.pool.cached for h in chain)
        yield engine, reference, chain
    finally:
        engine.close()


@pytest.mark.parametrize("family", GEMMAS)
def test_prefix_hit_over_released_and_evicted_window_parts(saved, tokenizer, family: str) -> None:
    """The hit at 64 tokens needs only block 3's window part: blocks 0-2's may be gone."""
    with _after_cold_run(saved, tokenizer, family) as (engine, reference, chain):
        _evict_window_parts(engine, chain[:3])
        again, cached = _generate(engine, "again", PROMPT)
        assert again.matches(reference) and cached == 64


def test_the_hit_reads_the_window_part_it_kept(saved, tokenizer) -> None:
    """Noise in block 3's kept window part changes the logprobs of the hit that uses it: the hit
    reads the window pool, it does not recompute."""
    with _after_cold_run(saved, tokenizer, "gemma3_text") as (engine, reference, chain):
        block = engine.scheduler.kv.window.pool.cached[chain[3]]
        cache = engine.runner.window_cache
        cache[block.block_id] = torch.randn(cache.shape[1:], generator=torch.Generator().manual_seed(0))
        noisy, cached = _generate(engine, "noisy", PROMPT)
        assert cached == 64 and not noisy.matches(reference)


@pytest.mark.parametrize("family", GEMMAS)
def test_a_missing_window_part_shortens_the_hit(saved, tokenizer, family: str) -> None:
    """Block 3's window part gone: the hit stops at 48 tokens (block 2's is kept); all gone: a miss."""
    with _after_cold_run(saved, tokenizer, family) as (engine, reference, chain):
        _evict_window_parts(engine, [chain[3]])
        shorter, cached = _generate(engine, "shorter", PROMPT)
        assert shorter.matches(reference) and cached == 48
        _evict_window_parts(engine, chain[:4])
        engine.scheduler.kv.window.pool.check_integrity()
        missed, cached = _generate(engine, "missed", PROMPT)
        assert missed.matches(reference) and cached == 0


def _chain(engine: LLMEngine) -> list[bytes]:
    """The block hashes of PROMPT's full blocks under this engine's root."""
    kv = engine.scheduler.kv
    return hash_blocks(PROMPT, BLOCK, kv.root_hash, ExtraKeys())


@pytest.mark.parametrize("family", GEMMAS)
def test_session_second_turn_resumes_its_window(saved, tokenizer, family: str) -> None:
    model, path, reference = saved[family]
    engine = _engine(load_model(path), tokenizer)
    try:
        first, _ = _generate(engine, "t1", PROMPT, session_id="chat")
        assert first.matches(reference)
        kv = engine.scheduler.kv
        held = kv.window.table(("session", "chat"))
        assert held is not None and held.count(NULL_BLOCK_ID) >= 5          # parked without its old window
        second_prompt = PROMPT + first.tokens + prompt_ids(9, seed=1)
        second, cached = _generate(engine, "t2", second_prompt, session_id="chat")
        assert cached == len(PROMPT) + NEW_TOKENS - 1
        assert second.matches(_hf_greedy(model, second_prompt))
        kv.window.pool.check_integrity()
    finally:
        engine.close()


def _generate_watching_window(engine: LLMEngine, rid: str, prompt: list[int],
                              session_id: str | None = None) -> tuple[Greedy, int, int]:
    """``_generate``, and the most window entries the request had released at once."""
    kv, released = engine.scheduler.kv, 0

    def count(request: Request) -> None:
        nonlocal released
        if kv.get_window_table(request) is not None:
            released = max(released, kv.get_window_table(request).count(NULL_BLOCK_ID))

    out, cached = _run_checking(engine, rid, prompt, count, session_id)
    return out, cached, released


def _flood(engine: LLMEngine) -> None:
    """Run other prompts through a small pool until PROMPT's blocks are gone from the device."""
    engine.connector_worker.wait_for_save()
    run(engine, {f"flood{i}": prompt_ids(70, seed=20 + i) for i in range(2)},
        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.connector_worker.wait_for_save()


@pytest.mark.parametrize("family", GEMMAS)
def test_tiers_keep_the_window_pool_and_restore_exactly(saved, tokenizer, tmp_path, family: str) -> None:
    """With a CPU and a disk tier the window layers keep their own pool and release blocks while
    a request runs; tier objects hold every layer, so a block restored from the CPU tier or
    (after a restart) the disk tier gives transformers' tokens and logprobs."""
    _, path, reference = saved[family]
    loaded = load_model(path)
    store = StoreConfig(cpu_offload_gb=0.01, disk_cache_dir=str(tmp_path))
    engine = _engine(loaded, tokenizer, num_blocks=8, store=store, chunk=64)
    try:
        assert engine.runner.window is not None and engine.scheduler.kv.window is not None
        cold, _, released = _generate_watching_window(engine, "cold", PROMPT)
        assert cold.matches(reference) and released >= 5
        _flood(engine)
        assert not any(h in engine.scheduler.kv.pool.cached for h in _chain(engine))
        restored, cached, _ = _generate_watching_window(engine, "restored", PROMPT)
        assert restored.matches(reference) and cached == 64
        assert {t.name: t.hit_tokens for t in engine.stats().tiers}["cpu"] >= 16
        engine.scheduler.kv.window.pool.check_integrity()
    finally:
        engine.close()
    engine = _engine(loaded, tokenizer, num_blocks=8, store=StoreConfig(disk_cache_dir=str(tmp_path)), chunk=64)
    try:
        assert engine.runner.window is not None
        from_disk, cached, released = _generate_watching_window(engine, "disk", PROMPT)
        assert from_disk.matches(reference) and cached == 64 and released >= 5
        assert engine.stats().connector.async_loads >= 1
    finally:
        engine.close()


def test_a_session_restored_from_the_cpu_tier(saved, tokenizer) -> None:
    """A session's second turn after its blocks left the device: restored from the CPU tier."""
    model, path, reference = saved["gemma3_text"]
    engine = _engine(load_model(path), tokenizer, num_blocks=12, store=StoreConfig(cpu_offload_gb=0.01), chunk=64)
    try:
        first, _ = _generate(engine, "t1", PROMPT, session_id="chat")
        assert first.matches(reference)
        engine.scheduler.end_session("chat")
        _flood(engine)
        second_prompt = PROMPT + first.tokens + prompt_ids(9, seed=1)
        second, cached = _generate(engine, "t2", second_prompt, session_id="chat")
        assert cached == (len(PROMPT) + NEW_TOKENS - 1) // BLOCK * BLOCK
        assert second.matches(_hf_greedy(model, second_prompt))
    finally:
        engine.close()


def _cpu_payloads(engine: LLMEngine) -> list[bytes]:
    """The CPU tier's objects for PROMPT's full blocks."""
    engine.connector_worker.wait_for_save()
    memory = engine.store.tiers[0].store
    return [bytes(memory.get(key)) for key in engine.connector_scheduler.key_space.keys(_chain(engine))]


@pytest.mark.parametrize("family", GEMMAS)
def test_tier_objects_are_those_of_a_one_pool_engine(saved, tokenizer, monkeypatch, family: str) -> None:
    """The two-pool engine writes each block as a one-pool engine does: every layer in layer order."""
    import kvhive.engine.assembly as engine_assembly

    _, path, reference = saved[family]
    loaded = load_model(path)
    store = StoreConfig(cpu_offload_gb=0.01)
    payloads = {}
    for pools in ("two", "one"):
        if pools == "one":
            monkeypatch.setattr(engine_assembly, "window_layout_for", lambda *args: None)
        engine = _engine(loaded, tokenizer, num_blocks=8, store=store, chunk=64)
        try:
            assert (engine.runner.window is not None) == (pools == "two")
            assert _generate(engine, "r", PROMPT)[0].matches(reference)
            payloads[pools] = _cpu_payloads(engine)
        finally:
            engine.close()
    assert len(payloads["two"]) == 4 and payloads["two"] == payloads["one"]


def test_a_load_cut_short_restarts_and_computes(saved, tokenizer, tmp_path) -> None:
    """A disk object that fails after the lookup: the load stops after block 0, whose window part
    no row needs, so the request starts again and computes (greedy equal, no tier lookup)."""
    _, path, reference = saved["gemma2"]
    loaded = load_model(path)
    engine = _engine(loaded, tokenizer, num_blocks=8, store=StoreConfig(disk_cache_dir=str(tmp_path)), chunk=64)
    try:
        assert _generate(engine, "cold", PROMPT)[0].matches(reference)
        engine.connector_worker.wait_for_save()
    finally:
        engine.close()
    engine = _engine(loaded, tokenizer, num_blocks=8, store=StoreConfig(disk_cache_dir=str(tmp_path)), chunk=64)
    try:
        bad = engine.connector_scheduler.key_space.key(_chain(engine)[1])
        get = engine.store.get
        engine.store.get = lambda key: None if key == bad else get(key)
        out, cached = _generate(engine, "cut", PROMPT)
        assert out.matches(reference) and cached == 0
        assert engine.scheduler.num_preemptions == 1 and not engine.scheduler.transfers.skip_lookup
    finally:
        engine.close()


def test_a_kv_role_keeps_one_pool(saved, tokenizer) -> None:
    """Disaggregated serving sends whole pool blocks: a Gemma engine with a KV role keeps one pool."""
    from kvhive.connector.disagg.transfer_config import KVTransferConfig

    _, path, reference = saved["gemma2"]
    engine = _engine(load_model(path), tokenizer, kv_transfer=KVTransferConfig(role="prefill", host="127.0.0.1"))
    try:
        assert engine.runner.window is None and engine.scheduler.kv.window is None
        assert _generate(engine, "r", PROMPT)[0].matches(reference)
    finally:
        engine.close()


def test_window_layers_decode_rows_read_only_their_window(saved) -> None:
    """A decode row at position 90 with a window of 8 sees 83..90: one window block (from 80)."""
    loaded = load_model(saved["gemma3_text"][1])
    layout = WindowLayout(loaded.config.gemma.window_layers, window=8, num_blocks=8)
    runner = ModelRunner(loaded.model, loaded.config, num_blocks=8, block_size=BLOCK, window=layout)
    seq = ScheduledSeq("r", [1], 90, [1, 2, 3, 4, 5, 6], True, SamplingParams(temperature=0),
                       window_table=[0, 0, 0, 0, 0, 6])
    attn = runner.prepare_inputs(StepPlan([seq])).attn
    assert attn.decode.block_tables.tolist() == [[1, 2, 3, 4, 5, 6]]
    assert attn.window.meta.decode.block_tables.tolist() == [[6]] and attn.window.decode_first_keys.tolist() == [80]
    assert attn.window.meta.slot_rows.tolist() == [[6 * 5 * 2 * BLOCK + 10, 6 * 5 * 2 * BLOCK + 10 + BLOCK]]


def test_the_window_pool_is_sized_for_the_windows_not_the_context(saved, tokenizer) -> None:
    """256 blocks of context: the window pool holds what two sequences' windows and a step need."""
    _, path, reference = saved["gemma3_text"]
    engine = _engine(load_model(path), tokenizer, num_blocks=256)
    try:
        runner = engine.runner
        assert runner.window_cache.shape[:2] == (runner.window.num_blocks, 5) and runner.kv_cache.shape[1] == 1
        assert runner.window.num_blocks < 32
        one_pool = 256 * runner.kv_cache[0].nbytes * 6
        assert runner.pool_bytes() < one_pool / 4
        out, _ = _generate(engine, "r", PROMPT)
        assert out.matches(reference)
    finally:
        engine.close()


def test_metrics_show_the_window_pool_by_state(saved, tokenizer) -> None:
    from dataclasses import replace

    from kvhive.server.metrics_collectors import EngineStatsCollector

    _, path, reference = saved["gemma2"]
    engine = _engine(load_model(path), tokenizer)
    try:
        assert _generate(engine, "r", PROMPT)[0].matches(reference)
        stats = engine.stats()
        assert stats.window_pool == engine.scheduler.kv.window.stats()

        def states(s) -> dict[str, float]:
            families = {m.name: m for m in EngineStatsCollector(lambda: s, "tiny").collect()}
            found = families.get("kvhive_window_kv_blocks")
            return {} if found is None else {x.labels["state"]: x.value for x in found.samples}

        window = states(stats)
        assert set(window) == {"free", "cached", "used"} and window["used"] == 0
        assert sum(window.values()) == stats.window_pool.num_blocks and window["cached"] >= 4
        assert states(replace(stats, window_pool=None)) == {}      # one pool: no window family
    finally:
        engine.close()


ISA_LEVELS = list(dict.fromkeys([cpu.detect().best] + [lvl for lvl in ("avx2", "portable")
                                                       if cpu.detect().supports(lvl)]))


@pytest.mark.parametrize("isa", ISA_LEVELS)
def test_the_two_pools_give_the_reference_tokens_at_every_kernel_level(saved, tokenizer, isa: str) -> None:
    """The global layers' pool (fewer layers per block than the model has) read by the attention
    kernels each CPU level builds (an AVX2-only or portable host's included), cold and from a hit."""
    _, path, reference = saved["gemma3_text"]
    config = EngineConfig(model_path="tiny", cpu_isa=isa, cache=CacheConfig(block_size=BLOCK, num_blocks=24),
                          scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=512))
    engine = LLMEngine(config, loaded=load_model(path, isa=isa), tokenizer=tokenizer)
    try:
        assert engine.runner.window is not None
        assert isa in engine.paths["decode_attention"], engine.paths
        assert engine.paths["prefill_attention"] in (f"C++ {isa}", "torch SDPA on gathered K/V"), engine.paths
        cold, _ = _generate(engine, "cold", PROMPT)
        hit, cached = _generate(engine, "hit", PROMPT)
        assert cold.matches(reference) and hit.matches(reference) and cached > 0
    finally:
        engine.close()


class _OracleDrafts:
    """Drafts of up to five tokens from the reference's own next tokens, spoiled from the first one
    that would start a new block (so the blocks allocated for the rest are trimmed), and every
    third draft from its third token: drafts accepted whole, cut short inside a block and at a
    block's start."""

    def __init__(self, prompt: list[int], reference: list[int]) -> None:
        self.full = prompt + reference
        self.calls = 0

    def __call__(self, request, max_tokens: int) -> list[int]:
        self.calls += 1
        n = request.num_tokens                  # draft j is the token at position n + j
        drafts = self.full[n:n + min(max_tokens, 5)]
        cut = (-n) % BLOCK if (-n) % BLOCK < len(drafts) else 2 if self.calls % 3 == 0 else len(drafts)
        return drafts[:cut] + [(t + 1) % 64 for t in drafts[cut:]]


DRAFT_PATHS = [(family, ISA_LEVELS[0], "auto") for family in GEMMAS] + [
    ("gemma3_text", isa, "auto") for isa in ISA_LEVELS[1:]] + [("gemma2", ISA_LEVELS[0], "torch")]


@pytest.mark.parametrize(("family", "isa", "attention"), DRAFT_PATHS)
def test_drafts_roll_back_in_both_pools_as_the_window_slides(saved, tokenizer, monkeypatch, family: str,
                                                              isa: str, attention: str) -> None:
    """Speculative decoding over a window pool: drafts accepted whole and cut short, while the
    window slides block after block, give transformers' tokens and logprobs (each window layer's
    drafted rows read their own window: the C++ decode kernel at every ISA level, torch attention);
    after every step the window entries released are exactly those before the window of the
    accepted tokens, the two tables have one entry per block the accepted tokens need, and both
    pools hold only them."""
    from kvhive.core.speculative_config import SpeculativeConfig

    _, path, reference = saved[family]
    engine = _engine(load_model(path, isa=isa), tokenizer, chunk=64, cpu_isa=isa, attention_backend=attention,
                     speculative=SpeculativeConfig(
        num_speculative_tokens=5, prompt_lookup_min=1, prompt_lookup_max=3, draft_sizing="per_request"))
    drafts = _OracleDrafts(PROMPT, reference.tokens)
    monkeypatch.setattr(engine.scheduler.speculation.proposer, "propose", drafts)
    try:
        kv = engine.scheduler.kv
        most_released, trimmed = 0, False
        trim = kv.trim_blocks

        def trim_counted(request, num_tokens: int) -> int:
            nonlocal trimmed
            freed = trim(request, num_tokens)
            trimmed = trimmed or freed > 0
            return freed

        def check(request: Request) -> None:
            nonlocal most_released
            table, window = kv.get_block_table(request), kv.get_window_table(request)
            assert len(table) == len(window) == -(-request.num_computed_tokens // BLOCK)
            released = [i for i, b in enumerate(window) if b == NULL_BLOCK_ID]
            assert released == list(range(kv.window.first_needed(request.num_computed_tokens)))
            most_released = max(most_released, len(released))
            assert kv.window.stats().num_used == kv.window.num_held("r") == len(window) - len(released)
            kv.window.pool.check_integrity()
            kv.pool.check_integrity()

        monkeypatch.setattr(kv, "trim_blocks", trim_counted)
        out, _ = _run_checking(engine, "r", PROMPT, check)
        stats = engine.stats().spec_decode
        assert out.matches(reference)
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens and most_released >= 4 and trimmed
        assert kv.window.stats().num_used == 0 and kv.pool.stats().num_used == 0
    finally:
        engine.close()
