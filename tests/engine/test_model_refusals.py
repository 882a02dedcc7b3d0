"""Checkpoints kvhive cannot run exactly are refused with the file and the field named: features
of a family it does not run, and broken checkpoints (corrupt or truncated files, a missing shard,
shapes that disagree with the config). Through the real ``kvhive serve`` these exit with code 2."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from support.families import edited_hf_copy, hf_model, path_in, save_gguf, save_hf
from support.servers import REPO_ROOT, free_port, subprocess_env

from kvhive.model.loader import load_model

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, str]:
    """Tiny llama and phi3 checkpoints: an HF dir, a sharded HF dir and a GGUF file each."""
    root = tmp_path_factory.mktemp("refusals")
    out = {}
    for family in ("llama", "phi3"):
        model = hf_model(family)
        out[f"{family}-hf"] = save_hf(model, path_in(root, family, "hf"))
        out[f"{family}-sharded"] = save_hf(model, path_in(root, family, "sharded"), max_shard_size="40KB")
        out[f"{family}-gguf"] = save_gguf(model, family, path_in(root, f"{family}.gguf"))
    return out


@pytest.mark.parametrize(("family", "changes", "named"), [
    ("llama", {"model_type": "olmo2"}, "model_type 'olmo2'"),
    ("llama", {"rope_parameters": None, "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8,
                                                         "long_factor": [1.0] * 8}}, "rope_scaling.rope_type 'longrope'"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4, "alpha": 1.0}},
     "rope_parameters.alpha"),
    ("llama", {"partial_rotary_factor": 0.75}, "partial_rotary_factor 0.75"),
    ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor 0.5"),
    ("llama", {"attention_bias": True}, "attention_bias True"),
    ("llama", {"mlp_bias": True}, "mlp_bias True"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ("llama", {"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ("llama", {"num_hidden_layers": 1}, "past num_hidden_layers = 1"),
    ("llama", {"intermediate_size": 96}, r"mlp\.\w+_proj\.weight has shape .* but the config \(.*intermediate_size"),
    ("phi3", {"num_key_value_heads": 4}, "qkv_proj.weight is not part of a phi3 model"),
    ("llama", {"hidden_size": None}, "hidden_size is missing"),
])
def test_unsupported_or_inconsistent_config_is_refused(saved, tmp_path, family: str, changes: dict, named: str) -> None:
    path = edited_hf_copy(saved[f"{family}-hf"], str(tmp_path / "m"), **changes)
    with pytest.raises(ValueError, match=named) as info:
        load_model(path)
    assert os.path.join(path, "") in str(info.value) or path in str(info.value)


def _gguf_with(tmp_path, family: str, **kwargs: object) -> str:
    return save_gguf(hf_model(family), family, str(tmp_path / "m.gguf"), **kwargs)


def test_gguf_rope_tensor_it_does_not_apply_is_refused(tmp_path) -> None:
    factors = {"rope_factors_long.weight": np.ones(8, np.float32)}
    with pytest.raises(ValueError, match=r"m\.gguf: GGUF tensor 'rope_factors_long.weight'"):
        load_model(_gguf_with(tmp_path, "phi3", extra_tensors=factors))


def test_gguf_rope_metadata_it_does_not_read_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"m\.gguf: GGUF metadata llama\.rope\.scaling\.yarn_log_multiplier"):
        load_model(_gguf_with(tmp_path, "llama", extra_meta={"llama.rope.scaling.yarn_log_multiplier": 1}))


def test_gguf_shape_mismatch_names_the_metadata_key(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"m\.gguf: blk\.0\.ffn_\w+\.weight: tensor .*llama\.feed_forward_length"):
        load_model(_gguf_with(tmp_path, "llama", extra_meta={"llama.feed_forward_length": 96}))


def test_llama3_gguf_without_rope_freqs_differs_and_with_them_matches(saved, tmp_path) -> None:
    """The rope_freqs tensor is applied: dropping it changes the model's RoPE tables."""
    with_freqs = load_model(saved["llama-gguf"])
    assert with_freqs.config.rope_scaling.freq_factors
    from_dir = load_model(saved["llama-hf"])
    torch.testing.assert_close(with_freqs.model.rope_cos, from_dir.model.rope_cos, rtol=0, atol=1e-5)


def _truncate(path: str, keep: float) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(int(size * keep))


def _corrupt(path: str) -> None:
    with open(path, "r+b") as f:
        f.write(b"\xff" * 64)


def _broken(saved: dict[str, str], tmp_path, kind: str) -> tuple[str, str]:
    """A broken copy of a checkpoint and the text the error must contain."""
    if kind == "truncated safetensors":
        path = shutil.copytree(saved["llama-hf"], str(tmp_path / "m"))
        _truncate(os.path.join(path, "model.safetensors"), 0.6)
        return path, "model.safetensors: not a readable safetensors file"
    if kind == "corrupt safetensors":
        path = shutil.copytree(saved["llama-hf"], str(tmp_path / "m"))
        _corrupt(os.path.join(path, "model.safetensors"))
        return path, "model.safetensors: not a readable safetensors file"
    if kind == "missing shard":
        path = shutil.copytree(saved["llama-sharded"], str(tmp_path / "m"))
        shards = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        os.remove(os.path.join(path, shards[-1]))
        return path, f"{shards[-1]}: missing shard"
    if kind == "truncated gguf":
        path = shutil.copy(saved["llama-gguf"], str(tmp_path / "m.gguf"))
        _truncate(path, 0.5)
        return path, "m.gguf: not a readable GGUF file"
    if kind == "corrupt gguf":
        path = shutil.copy(saved["llama-gguf"], str(tmp_path / "m.gguf"))
        _corrupt(path)
        return path, "m.gguf: not a readable GGUF file"
    path = edited_hf_copy(saved["llama-hf"], str(tmp_path / "m"), num_key_value_heads=1)
    return path, "k_proj.weight has shape"


BROKEN = ["truncated safetensors", "corrupt safetensors", "missing shard", "truncated gguf", "corrupt gguf",
          "shape mismatch"]


@pytest.mark.parametrize("kind", BROKEN)
def test_broken_checkpoint_is_an_error_naming_the_file(saved, tmp_path, kind: str) -> None:
    path, named = _broken(saved, tmp_path, kind)
    with pytest.raises(ValueError, match=named.replace(".", r"\.").replace("[", r"\[")):
        load_model(path)


@pytest.mark.parametrize("kind", ["truncated safetensors", "corrupt gguf", "shape mismatch"])
def test_serve_exits_2_on_a_broken_checkpoint(saved, tmp_path, kind: str) -> None:
    path, named = _broken(saved, tmp_path, kind)
    proc = subprocess.run([sys.executable, "-m", "kvhive.cli", "serve", "--model", path, "--port", str(free_port()),
                           "--kv-cache-gb", "0.01"], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
                          env=subprocess_env())
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert named in proc.stderr, proc.stderr[-2000:]
