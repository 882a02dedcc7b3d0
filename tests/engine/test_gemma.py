"""Gemma 2 and Gemma 3 (text) beyond the per-family reference tests: which attention path each
layer takes, prompts prefilled in chunks longer and shorter than the window, a score scale other
than the head size, Gemma 3's older config.json layout, and the refusals by config key.

The windows (8 keys) are shorter than every prompt, so a layer that attended to its whole context
would give other logits and tokens than transformers (checked: the shared path on a window layer
does).
"""

from __future__ import annotations

import pytest
import torch
from support.engines import run
from support.families import edited_hf_copy, hf_model, path_in, prompt_ids, save_hf

from kvhive.config import CacheConfig, EngineConfig, SchedulerConfig
from kvhive.engine.llm_engine import LLMEngine
from kvhive.engine.runner import ModelRunner
from kvhive.engine.step import ScheduledSeq, StepPlan
from kvhive.model.loader import LoadedModel, load_model
from kvhive.request import SamplingParams

pytest.importorskip("transformers")

BLOCK = 16
PROMPT = prompt_ids(40)
GEMMAS = ("gemma2", "gemma3_text")
NEW_TOKENS = 24
TOL = 1e-5                          # float32, relative to the largest |logit|


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[torch.nn.Module, str]]:
    """Per family: the transformers model and its HF directory."""
    root = tmp_path_factory.mktemp("gemma")
    out = {}
    for family in GEMMAS:
        model = hf_model(family)
        out[family] = (model, save_hf(model, path_in(root, family)))
    return out


def _logits(loaded: LoadedModel, prompt: list[int], native: bool = True) -> torch.Tensor:
    """kvhive's logits [len(prompt), vocab] of one prefill over the paged cache."""
    blocks = -(-len(prompt) // BLOCK)
    runner = ModelRunner(loaded.model, loaded.config, num_blocks=blocks, block_size=BLOCK, native_attention=native)
    plan = StepPlan([ScheduledSeq("x", prompt, 0, list(range(blocks)), True, SamplingParams(temperature=0))])
    inputs = runner.prepare_inputs(plan, all_rows=True)
    with torch.inference_mode():
        return loaded.model.compute_logits(loaded.model(inputs.input_ids, inputs.positions, inputs.attn,
                                                        runner.kv_cache))


def _error(ours: torch.Tensor, model: torch.nn.Module, prompt: list[int]) -> float:
    """max |kvhive - transformers| over the logits, relative to transformers' largest |logit|."""
    with torch.inference_mode():
        theirs = model(torch.tensor([prompt])).logits[0].float()
    return float((ours - theirs).abs().max()) / float(theirs.abs().max())


def _hf_greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_each_layer_takes_the_path_that_applies_its_window_and_cap(saved) -> None:
    """Gemma 2 soft-caps every layer: all masked. Gemma 3: its window layers masked, the global
    layer on the runner's kernels (pre-scaled queries); /version names the masked layers."""
    gemma2, gemma3 = load_model(saved["gemma2"][1]), load_model(saved["gemma3_text"][1])
    assert gemma2.model.attention_paths() == ["masked", "masked"]
    assert gemma3.model.attention_paths() == ["masked"] * 5 + ["shared"]
    assert gemma3.model.paths()["windowed_attention"] == "masked torch, layers 0,1,2,3,4"


@pytest.mark.parametrize("family", GEMMAS)
def test_a_window_layer_on_the_shared_path_would_be_wrong(saved, family: str) -> None:
    """The reference tests can tell: attending to the whole context differs from transformers."""
    model, path = saved[family]
    loaded = load_model(path)
    assert _error(_logits(loaded, PROMPT), model, PROMPT) < TOL
    loaded.model.rules = [None] * len(loaded.model.rules)
    assert _error(_logits(loaded, PROMPT), model, PROMPT) > 1e-3


@pytest.mark.parametrize("family", GEMMAS)
@pytest.mark.parametrize("native", [True, False])
def test_chunked_prefill_and_decode_equal_transformers(saved, tokenizer, family: str, native: bool) -> None:
    """Chunks of 16 (twice the window) and of 5 (decode rows over the cached prefix where the C++
    kernels run), each over a prefix the window has left behind, then decode."""
    model, path = saved[family]
    prompt = prompt_ids(61, seed=3)
    reference = _hf_greedy(model, prompt)
    loaded = load_model(path)
    for chunk in (16, 5):
        config = EngineConfig(model_path="tiny", cache=CacheConfig(block_size=BLOCK, num_blocks=16),
                              scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=chunk, max_model_len=512),
                              native_attention=native)
        engine = LLMEngine(config, loaded=loaded, tokenizer=tokenizer)
        try:
            sampling = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
            tokens, _ = run(engine, {"r": prompt}, sampling)["r"]
        finally:
            engine.close()
        assert tokens == reference, f"{family} chunks of {chunk}"


@pytest.mark.parametrize("family", GEMMAS)
def test_query_pre_attn_scalar_scales_the_scores(tmp_path, family: str) -> None:
    """A score scale other than 1/sqrt(head_dim) on the masked and on the shared path."""
    model = hf_model(family, query_pre_attn_scalar=24)
    loaded = load_model(save_hf(model, str(tmp_path / "m")))
    assert loaded.config.gemma is not None and loaded.config.gemma.query_pre_attn_scalar == 24
    for native in (True, False):
        assert _error(_logits(loaded, PROMPT, native), model, PROMPT) < TOL


def test_gemma3_older_config_layout_loads_the_same_model(saved, tmp_path) -> None:
    """rope_theta, rope_scaling and rope_local_base_freq instead of per-type rope_parameters, and
    sliding_window_pattern instead of layer_types."""
    model, path = saved["gemma3_text"]
    old = edited_hf_copy(path, str(tmp_path / "old"), rope_parameters=None, layer_types=None, rope_theta=1000000.0,
                       rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 2.0},
                       sliding_window_pattern=6)
    loaded = load_model(old)
    assert loaded.config == load_model(path).config
    assert _error(_logits(loaded, PROMPT), model, PROMPT) < TOL


@pytest.mark.parametrize(("family", "changes", "named"), [
    ("gemma3_text", {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]},
     r"architectures \['Gemma3ForConditionalGeneration'\] is not supported"),
    ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention True"),
    ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
    ("gemma2", {"layer_types": ["sliding_attention", "chunked_attention"]}, r"layer_types\[1\] 'chunked_attention'"),
    ("gemma2", {"layer_types": ["full_attention"]}, "layer_types must list one type per layer"),
    ("gemma2", {"sliding_window": 0}, "sliding_window must be a positive integer"),
    ("gemma2", {"attn_logit_softcapping": -1.0}, "attn_logit_softcapping must be a positive number"),
    ("gemma3_text", {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0},
                                         "full_attention": {"rope_type": "default"}}},
     "rope_parameters.sliding_attention.rope_type 'linear'"),
    ("gemma3_text", {"num_hidden_layers": 5, "layer_types": None}, "past num_hidden_layers = 5"),
])
def test_unsupported_gemma_config_is_refused(saved, tmp_path, family: str, changes: dict, named: str) -> None:
    path = edited_hf_copy(saved[family][1], str(tmp_path / "m"), **changes)
    with pytest.raises(ValueError, match=named) as info:
        load_model(path)
    assert path in str(info.value)
