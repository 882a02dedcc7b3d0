"""kvhive against transformers on tiny random checkpoints of every family it runs.

Each family (Llama 3 with llama3 RoPE and tied embeddings, Qwen2 with QKV bias and yarn, Qwen3
with q/k norms, a 32-wide head and linear RoPE, Mistral with dynamic NTK, Phi-3 with fused
projections) is built with transformers, written as an HF directory and as a GGUF file the way
llama.cpp's converter writes it, and loaded through kvhive's loader. Logits must equal
transformers' (per dtype) and 32 greedy tokens must equal transformers' generate: cold, from
the prefix cache, from the CPU tier after the device pool evicted the prefix, and as the second
turn of a session.
"""

from __future__ import annotations

import pytest
import torch
from support.engines import run, turn
from support.families import FAMILIES, hf_model, path_in, prompt_ids, save_gguf, save_hf

from kvhive.config import CacheConfig, EngineConfig, SchedulerConfig, StoreConfig
from kvhive.core.speculative_config import SpeculativeConfig
from kvhive.engine.llm_engine import LLMEngine
from kvhive.engine.runner import ModelRunner
from kvhive.engine.step import ScheduledSeq, StepPlan
from kvhive.model.loader import LoadedModel, load_model
from kvhive.request import SamplingParams

pytest.importorskip("transformers")

NEW_TOKENS = 32
BLOCK = 16
PROMPT = prompt_ids(40)
FOLLOW_UP = prompt_ids(9, seed=1)
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
TIE_GAP = 2e-3              # a top-2 gap this small in transformers' scores may flip under float32 rounding
# max |kvhive - transformers| over the logits, relative to the largest |logit|, by compute dtype.
LOGIT_TOL = {"float32": 1e-5, "bfloat16": 0.03}
FAMILY_NAMES = sorted(FAMILIES)
NGRAM = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3, draft_sizing="per_request")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[torch.nn.Module, dict[str, str]]]:
    """Per family: the transformers model and its files ({"hf", "gguf", "hf-bf16", "hf-f16"}: path)."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for family in FAMILY_NAMES:
        model = hf_model(family)
        files = {"hf": save_hf(model, path_in(root, family, "hf")),
                 "gguf": save_gguf(model, family, path_in(root, f"{family}.gguf")),
                 "hf-bf16": save_hf(model, path_in(root, family, "bf16"), torch.bfloat16),
                 "hf-f16": save_hf(model, path_in(root, family, "f16"), torch.float16, max_shard_size="40KB")}
        out[family] = (model, files)
    return out


def _prompt_logits(loaded: LoadedModel, prompt: list[int]) -> torch.Tensor:
    """kvhive's logits [len(prompt), vocab] of one prefill over the paged cache."""
    blocks = -(-len(prompt) // BLOCK)
    runner = ModelRunner(loaded.model, loaded.config, num_blocks=blocks, block_size=BLOCK,
                         dtype=str(loaded.model.dtype).removeprefix("torch."))
    plan = StepPlan([ScheduledSeq("x", prompt, 0, list(range(blocks)), True, SamplingParams(temperature=0))])
    inputs = runner.prepare_inputs(plan, all_rows=True)
    with torch.inference_mode():
        hidden = loaded.model(inputs.input_ids, inputs.positions, inputs.attn, runner.kv_cache)
        return loaded.model.compute_logits(hidden)


def _hf_logits(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0].float()


def _hf_greedy(model: torch.nn.Module, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [s[0] for s in out.scores]


def _assert_same_greedy(reference: tuple[list[int], list[torch.Tensor]], ours: list[int], what: str) -> None:
    """Equal tokens; at the first difference transformers' own top-2 must be a float32 tie."""
    theirs, scores = reference
    assert len(ours) == len(theirs) == NEW_TOKENS, what
    for j, (a, b) in enumerate(zip(theirs, ours, strict=True)):
        if a != b:
            gap = float(scores[j][a] - scores[j][b])
            assert gap < TIE_GAP, f"{what}: step {j}: {theirs} != {ours}"
            return


def _assert_logits_close(ours: torch.Tensor, theirs: torch.Tensor, dtype: str) -> None:
    err = float((ours.float() - theirs).abs().max()) / float(theirs.abs().max())
    assert err < LOGIT_TOL[dtype], f"{dtype}: relative logit error {err:.2e}"


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_float32_logits_equal_transformers(checkpoints, family: str, source: str) -> None:
    model, files = checkpoints[family]
    loaded = load_model(files[source])
    _assert_logits_close(_prompt_logits(loaded, PROMPT), _hf_logits(model, PROMPT), "float32")


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize(("source", "file_dtype"), [("hf-bf16", torch.bfloat16), ("hf-f16", torch.float16)])
def test_half_precision_files_load_exactly(checkpoints, family: str, source: str, file_dtype: torch.dtype) -> None:
    """bf16 and f16 files (the f16 one sharded) hold the rounded weights; in float32 kvhive equals
    transformers on those same weights."""
    model, files = checkpoints[family]
    rounded = hf_model(family)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(file_dtype).float())
    loaded = load_model(files[source])
    _assert_logits_close(_prompt_logits(loaded, PROMPT), _hf_logits(rounded, PROMPT), "float32")


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_bfloat16_compute_tracks_transformers(checkpoints, family: str) -> None:
    model, files = checkpoints[family]
    loaded = load_model(files["hf-bf16"], dtype="bfloat16")
    theirs = _hf_logits(hf_model(family).to(torch.bfloat16), PROMPT)
    _assert_logits_close(_prompt_logits(loaded, PROMPT), theirs, "bfloat16")


def _engine(loaded: LoadedModel, tokenizer, prefix: bool = True, speculative: SpeculativeConfig | None = None
            ) -> LLMEngine:
    """An engine with prefix caching, a 12-block device pool and a CPU tier (``speculative``: drafts)."""
    config = EngineConfig(model_path="tiny", cache=CacheConfig(block_size=BLOCK, num_blocks=12,
                                                                enable_prefix_caching=prefix),
                          scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=512),
                          store=StoreConfig(cpu_offload_gb=0.01) if prefix else StoreConfig(),
                          speculative=speculative)
    return LLMEngine(config, loaded=loaded, tokenizer=tokenizer)


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_greedy_tokens_equal_transformers_cold_cached_and_from_cpu_tier(checkpoints, tokenizer, family: str,
                                                                         source: str) -> None:
    model, files = checkpoints[family]
    reference = _hf_greedy(model, PROMPT)
    engine = _engine(load_model(files[source]), tokenizer)
    try:
        cold, cold_cached = run(engine, {"cold": PROMPT}, GREEDY)["cold"]
        _assert_same_greedy(reference, cold, f"{family} {source} cold")
        engine.connector_worker.wait_for_save()
        again, cached = run(engine, {"again": PROMPT}, GREEDY)["again"]
        # two full blocks from the device, and the tokens before the last copied from the third
        # (whole blocks only where window layers keep a pool of their own)
        device_hit = 32 if engine.runner.window is not None else len(PROMPT) - 1
        assert cold_cached == 0 and cached == device_hit and again == cold
        flood = {f"flood{i}": prompt_ids(60, seed=10 + i) for i in range(4)}
        run(engine, flood, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        engine.connector_worker.wait_for_save()
        restored, cached = run(engine, {"restored": PROMPT}, GREEDY)["restored"]
        assert cached == 32 and restored == cold
        assert {t.name: t.hit_tokens for t in engine.stats().tiers}["cpu"] >= 16      # came back from the CPU tier
    finally:
        engine.close()


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_session_second_turn_equals_transformers(checkpoints, tokenizer, family: str) -> None:
    model, files = checkpoints[family]
    engine = _engine(load_model(files["hf"]), tokenizer)
    try:
        first, _, _ = turn(engine, "t1", PROMPT, session_id="chat", sampling=GREEDY)
        second_prompt = PROMPT + first + FOLLOW_UP
        second, cached, _ = turn(engine, "t2", second_prompt, session_id="chat", sampling=GREEDY)
        assert cached >= len(PROMPT) + len(first) - BLOCK
        _assert_same_greedy(_hf_greedy(model, second_prompt), second, f"{family} session turn 2")
    finally:
        engine.close()


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_greedy_tokens_with_ngram_drafts_equal_plain_ones(checkpoints, tokenizer, family: str) -> None:
    """Speculative decoding (n-gram, k 3, lookups of 1..3 tokens: a random model's repetitive output
    finds drafts) gives the plain greedy tokens, a family with window layers (their own pool) too."""
    loaded = load_model(checkpoints[family][1]["hf"])
    prompts = {"a": PROMPT, "b": prompt_ids(23, seed=2)}
    outputs, stats, window = {}, {}, False
    for name, speculative in (("plain", None), ("ngram", NGRAM)):
        engine = _engine(loaded, tokenizer, speculative=speculative)
        try:
            outputs[name] = run(engine, prompts, GREEDY)
            stats[name], window = engine.stats().spec_decode, engine.runner.window is not None
        finally:
            engine.close()
    assert outputs["ngram"] == outputs["plain"]
    assert window == family.startswith("gemma")
    assert stats["ngram"].num_accepted_tokens > 0
