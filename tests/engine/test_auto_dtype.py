"""``--dtype auto`` picks the checkpoint's dtype where the device runs it well, else float32; and
``--model`` takes a Hugging Face repo id from the local HF cache (a clear error when absent)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from support.families import hf_model, path_in, save_gguf, save_hf
from support.servers import REPO_ROOT, free_port, subprocess_env

from kvhive.core.model_files import default_model_path
from kvhive.model import cpu
from kvhive.model.auto_dtype import checkpoint_dtype, choose_dtype, resolve_hub_model

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("dtypes")
    model = hf_model("qwen2")
    return {"float32": save_hf(model, path_in(root, "f32")),
            "bfloat16": save_hf(model, path_in(root, "bf16"), torch.bfloat16),
            "float16": save_hf(model, path_in(root, "f16"), torch.float16, max_shard_size="40KB"),
            "gguf": save_gguf(model, "qwen2", path_in(root, "m.gguf"))}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_checkpoint_dtype_from_config_or_safetensors(dirs, tmp_path, dtype: str) -> None:
    assert checkpoint_dtype(dirs[dtype]) == dtype
    undeclared = shutil.copytree(dirs[dtype], str(tmp_path / "m"))
    with open(os.path.join(undeclared, "config.json")) as f:
        raw = json.load(f)
    raw.pop("dtype", None)
    raw.pop("torch_dtype", None)
    with open(os.path.join(undeclared, "config.json"), "w") as f:
        json.dump(raw, f)
    assert checkpoint_dtype(undeclared) == dtype          # read from the safetensors header


def test_cpu_choices(dirs) -> None:
    features = cpu.detect()
    fast_bf16 = features.bf16_packing(features.best)
    assert choose_dtype(dirs["float32"], "cpu").dtype == "float32"
    assert choose_dtype(dirs["bfloat16"], "cpu").dtype == ("bfloat16" if fast_bf16 else "float32")
    if features.x86:
        assert choose_dtype(dirs["bfloat16"], "cpu", "avx2").dtype == "float32"     # no fast bf16 at that level
    assert choose_dtype(dirs["float16"], "cpu").dtype == "float32"
    assert choose_dtype(dirs["gguf"], "cpu").dtype == "float32"
    quantized = choose_dtype(default_model_path(), "cpu")
    assert quantized.dtype == "float32" and "quantised" in quantized.reason


def _cache_with(root: str, repo_id: str, files: dict[str, str]) -> str:
    """An HF hub cache under ``root`` holding one snapshot of ``repo_id`` with ``files`` copied in."""
    repo = os.path.join(root, "models--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", "0123abcd")
    os.makedirs(snapshot)
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write("0123abcd")
    for name, src in files.items():
        (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, os.path.join(snapshot, name))
    return snapshot


def test_repo_id_resolves_from_the_local_cache(dirs, tmp_path) -> None:
    hub = str(tmp_path / "hub")
    hf_files = {n: os.path.join(dirs["bfloat16"], n) for n in os.listdir(dirs["bfloat16"])}
    snapshot = _cache_with(hub, "acme/tiny-qwen", hf_files)
    assert resolve_hub_model("acme/tiny-qwen", cache_dir=hub) == snapshot
    gguf_snapshot = _cache_with(hub, "acme/tiny-qwen-GGUF", {"tiny.Q8_0.gguf": dirs["gguf"]})
    assert resolve_hub_model("acme/tiny-qwen-GGUF", cache_dir=hub) == os.path.join(gguf_snapshot, "tiny.Q8_0.gguf")
    with pytest.raises(ValueError, match="acme/absent is neither a local path nor a Hugging Face repo"):
        resolve_hub_model("acme/absent", cache_dir=hub)
    with pytest.raises(ValueError, match="no/such/path does not exist"):
        resolve_hub_model("no/such/path", cache_dir=hub)


def test_serve_names_a_repo_id_missing_from_the_cache_and_exits_2(tmp_path) -> None:
    env = subprocess_env({"HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"})
    proc = subprocess.run([sys.executable, "-m", "kvhive.cli", "serve", "--model", "acme/not-downloaded",
                           "--port", str(free_port())], capture_output=True, text=True, timeout=120,
                          cwd=REPO_ROOT, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "acme/not-downloaded is neither a local path nor a Hugging Face repo" in proc.stderr
