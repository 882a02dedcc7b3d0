"""``--load-format dummy``: a model of every family built from its config.json alone, with random
weights that are deterministic, finite in bfloat16 and in the dtype asked for; configs kvhive cannot
run refused as a checkpoint's are; the tokenizer taken from the model's files or refused by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from support.families import FAMILIES, edited_hf_copy, hf_config, hf_model, path_in, prompt_ids, save_hf
from support.servers import REPO_ROOT, free_port, subprocess_env
from support.tokenizer_families import family_tokenizer

from kvhive.cli import resolve_auto_dtype
from kvhive.config import EngineConfig, SchedulerConfig
from kvhive.core.model_files import default_model_path
from kvhive.engine import assembly
from kvhive.engine.llm_engine import LLMEngine
from kvhive.engine.runner import ModelRunner
from kvhive.engine.step import ScheduledSeq, StepPlan
from kvhive.model.auto_dtype import declared_dtype
from kvhive.model.loader import LoadedModel, load_model
from kvhive.request import SamplingParams

pytest.importorskip("transformers")

BLOCK = 16
PROMPT = prompt_ids(20)
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _config_dir(root, family: str, **overrides: object) -> str:
    """A directory holding only ``family``'s tiny config.json."""
    path = path_in(root, family)
    hf_config(family, **overrides).save_pretrained(path)
    return path


def _logits(loaded: LoadedModel, prompt: list[int]) -> torch.Tensor:
    """The model's logits [len(prompt), vocab] of one prefill through the runner's paged cache."""
    blocks = -(-len(prompt) // BLOCK)
    runner = ModelRunner(loaded.model, loaded.config, num_blocks=blocks, block_size=BLOCK,
                         dtype=loaded.model.dtype, device=loaded.model.device, cuda_graphs=False)
    plan = StepPlan([ScheduledSeq("x", prompt, 0, list(range(blocks)), True, SamplingParams(temperature=0))])
    inputs = runner.prepare_inputs(plan, all_rows=True)
    with torch.inference_mode():
        return loaded.model.compute_logits(loaded.model(inputs.input_ids, inputs.positions, inputs.attn,
                                                        runner.kv_cache))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_builds_with_finite_deterministic_logits(tmp_path, family: str) -> None:
    path = _config_dir(tmp_path, family)
    loaded = load_model(path, dtype="bfloat16", load_format="dummy")
    assert loaded.fingerprint.startswith("dummy-")
    assert all(p.dtype in (torch.bfloat16, torch.float32) for p in loaded.model.parameters())
    assert loaded.model.embed_tokens.dtype == torch.bfloat16
    logits = _logits(loaded, PROMPT)
    assert logits.shape == (len(PROMPT), loaded.config.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all() and logits.std() > 0
    # The same weights again (bf16 CPU kernels may sum in another order: the logits are compared closely).
    again = load_model(path, dtype="bfloat16", load_format="dummy", pack_weights=False)
    assert again.fingerprint == loaded.fingerprint
    assert _same_weights(again, load_model(path, dtype="bfloat16", load_format="dummy", pack_weights=False))
    torch.testing.assert_close(_logits(again, PROMPT), logits, atol=0.02, rtol=0.02)
    other = load_model(path, dtype="bfloat16", load_format="dummy", seed=1, pack_weights=False)
    assert other.fingerprint != loaded.fingerprint and not _same_weights(other, again)


def _same_weights(a: LoadedModel, b: LoadedModel) -> bool:
    """True when every parameter of ``a`` equals ``b``'s."""
    ours, theirs = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    return ours.keys() == theirs.keys() and all(torch.equal(ours[n], theirs[n]) for n in ours)


def test_the_family_shapes_and_biases_follow_the_config(tmp_path) -> None:
    qwen2 = load_model(_config_dir(tmp_path, "qwen2"), load_format="dummy").model
    assert qwen2.qkv_bias and qwen2.layers[0].qkv_bias is not None
    qwen3 = load_model(_config_dir(tmp_path, "qwen3"), load_format="dummy", pack_weights=False).model
    assert qwen3.layers[0].q_norm is not None
    assert tuple(qwen3.layers[0].qkv_proj.shape) == ((4 + 2 * 2) * 32, 64)       # head_dim 32
    assert torch.equal(qwen3.layers[0].q_norm, torch.ones(32))


def test_float16_and_float32_models_are_made_in_their_dtype(tmp_path) -> None:
    path = _config_dir(tmp_path, "llama")
    for dtype, torch_dtype in (("float16", torch.float16), ("float32", torch.float32)):
        loaded = load_model(path, dtype=dtype, load_format="dummy", pack_weights=False)
        assert {p.dtype for p in loaded.model.parameters()} == {torch_dtype}


def test_a_bare_config_file_and_hf_config_path_name_the_same_model(tmp_path) -> None:
    path = _config_dir(tmp_path, "mistral")
    in_dir = load_model(path, load_format="dummy")
    bare = load_model(os.path.join(path, "config.json"), load_format="dummy")
    assert bare.fingerprint == in_dir.fingerprint and bare.config == in_dir.config
    # The config from --hf-config-path wins over the model's (here a GGUF file with its own).
    elsewhere = load_model(default_model_path(), load_format="dummy", hf_config_path=path)
    assert elsewhere.config == in_dir.config


def test_a_dummy_fingerprint_is_never_the_checkpoints(tmp_path) -> None:
    real = load_model(default_model_path())
    path = path_in(tmp_path, "smollm2")
    os.makedirs(path)
    loaded = load_model(default_model_path(), load_format="dummy",
                        hf_config_path=_write_json(path, hf_config("llama", vocab_size=real.config.vocab_size)))
    assert loaded.fingerprint != real.fingerprint and loaded.fingerprint.startswith("dummy-")


def _write_json(directory: str, config) -> str:  # noqa: ANN001 - a transformers config
    """``config`` as directory/config.json; the file's path."""
    config.save_pretrained(directory)
    return os.path.join(directory, "config.json")


@pytest.mark.parametrize(("change", "named"), [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "falcon"}, "model_type 'falcon'"),
    ({"hidden_size": None}, "hidden_size is missing"),
    ({"num_hidden_layers": 2.5}, "num_hidden_layers must be an integer"),
])
def test_a_config_kvhive_cannot_run_is_refused_naming_the_file_and_field(tmp_path, change, named) -> None:
    path = _config_dir(tmp_path, "llama")
    file = os.path.join(path, "config.json")
    with open(file) as f:
        raw = json.load(f)
    raw.update({k: v for k, v in change.items() if v is not None})
    for key in [k for k, v in change.items() if v is None]:
        raw.pop(key, None)
    with open(file, "w") as f:
        json.dump(raw, f)
    with pytest.raises(ValueError, match=named) as info:
        load_model(path, load_format="dummy")
    assert file in str(info.value)


def test_a_gguf_without_a_config_is_refused() -> None:
    with pytest.raises(ValueError, match="--hf-config-path"):
        load_model(default_model_path(), load_format="dummy")


def test_the_engine_serves_a_dummy_model_with_the_directorys_tokenizer(tmp_path) -> None:
    path = _config_dir(tmp_path, "qwen3", vocab_size=1024)
    family_tokenizer("qwen3", path)
    config = EngineConfig(model_path=os.path.join(path, "config.json"), load_format="dummy",
                          scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64))
    engine = LLMEngine(config)
    assert engine.fingerprint.startswith("dummy-")
    engine.add_request("r", PROMPT, GREEDY)
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    assert len(tokens) == 4 and all(0 <= t < 1024 for t in tokens)


def test_a_dummy_model_without_a_tokenizer_is_refused_naming_it(tmp_path) -> None:
    path = _config_dir(tmp_path, "llama")
    with pytest.raises(ValueError, match="tokenizer.json"):
        assembly.load_tokenizer(EngineConfig(model_path=path, load_format="dummy"))


def test_the_config_declares_the_auto_dtype(tmp_path) -> None:
    path = _config_dir(tmp_path, "llama", dtype="bfloat16")
    assert declared_dtype(os.path.join(path, "config.json")) == "bfloat16"
    assert declared_dtype(_config_dir(tmp_path, "phi3")) in (None, "float32")


def test_auto_dtype_of_a_bare_config_file_reads_the_config(tmp_path) -> None:
    path = _config_dir(tmp_path, "llama", dtype="float32")
    config = EngineConfig(model_path=os.path.join(path, "config.json"), load_format="dummy", dtype="auto")
    assert resolve_auto_dtype(config).dtype == "float32"


def test_hf_config_path_replaces_a_checkpoints_config_and_is_checked_against_its_tensors(tmp_path) -> None:
    weights = save_hf(hf_model("qwen2"), path_in(tmp_path, "qwen2"))
    same = edited_hf_copy(weights, path_in(tmp_path, "same"), rms_norm_eps=1e-3)
    loaded = load_model(weights, hf_config_path=os.path.join(same, "config.json"))
    assert loaded.config.rms_norm_eps == 1e-3 and not loaded.fingerprint.startswith("dummy-")
    wider = edited_hf_copy(weights, path_in(tmp_path, "wider"), intermediate_size=256)
    with pytest.raises(ValueError, match="intermediate_size"):
        load_model(weights, hf_config_path=wider)
    with pytest.raises(ValueError, match="--hf-config-path"):
        load_model(default_model_path(), hf_config_path=wider)


def test_serve_exits_2_on_a_config_it_cannot_run(tmp_path) -> None:
    path = _config_dir(tmp_path, "llama", hidden_act="relu")
    proc = subprocess.run([sys.executable, "-m", "kvhive.cli", "serve", "--model", default_model_path(),
                           "--load-format", "dummy", "--hf-config", path, "--port", str(free_port())],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, env=subprocess_env())
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert os.path.join(path, "config.json") in proc.stderr and "hidden_act" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_dummy_model_is_made_on_the_device_in_bf16(tmp_path) -> None:
    path = _config_dir(tmp_path, "llama")
    before = torch.cuda.memory_allocated()
    loaded = load_model(path, dtype="bfloat16", device="cuda", load_format="dummy")
    assert {p.device.type for p in loaded.model.parameters()} == {"cuda"}
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert torch.cuda.memory_allocated() > before
    again = load_model(path, dtype="bfloat16", device="cuda", load_format="dummy")
    assert torch.equal(again.model.layers[0].qkv_proj, loaded.model.layers[0].qkv_proj)
    assert torch.isfinite(_logits(loaded, PROMPT)).all()
