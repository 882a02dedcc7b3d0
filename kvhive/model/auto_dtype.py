"""``--dtype auto``: the checkpoint's dtype where the device runs it well, else float32; and
``--model`` given as a Hugging Face repo id, found in the local Hugging Face cache (no network).

The checkpoint's dtype is config.json's ``dtype`` (``torch_dtype`` before transformers 5), else
the first safetensors tensor's, or for a GGUF file the type of its matrices (a quantised file
runs in float32, the dtype it is dequantised to). A CPU runs bfloat16 well where oneDNN packs
bf16 weights (AVX-512 or AVX-NE-CONVERT: ``CpuFeatures.bf16_packing``) and float16 never (the
CPU kernels compute in float32 or bfloat16); CUDA runs both, bfloat16 where the GPU supports it.
"""

from __future__ import annotations

import glob
import json
import os
from typing import NamedTuple

_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
_GGUF_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
_HF_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


class DtypeChoice(NamedTuple):
    """The dtype ``auto`` picked and why (for the startup log)."""

    dtype: str
    reason: str


def checkpoint_dtype(path: str) -> str:
    """float32, bfloat16, float16, or "quantized" (a GGUF of quantised matrices)."""
    if os.path.isdir(path):
        return _hf_dir_dtype(path)
    from kvhive.model.gguf_file import gguf_reader

    kinds = {t.tensor_type.name for t in gguf_reader(path).tensors if len(t.shape) == 2}
    if kinds and kinds <= set(_GGUF_DTYPES):
        for kind in ("F32", "F16", "BF16"):           # the widest type present
            if kind in kinds:
                return _GGUF_DTYPES[kind]
    return "quantized"


def declared_dtype(config_path: str) -> str | None:
    """The dtype the config.json at ``config_path`` (the file or its directory) declares, if any."""
    from kvhive.model.hf_dir import read_config_json

    raw = read_config_json(config_path)
    declared = raw.get("dtype") or raw.get("torch_dtype")
    return _HF_DTYPES[str(declared)] if declared in _HF_DTYPES else None


def _hf_dir_dtype(path: str) -> str:
    """The dtype config.json declares, else the first safetensors tensor's (float32 when unknown)."""
    declared = declared_dtype(path)
    if declared is not None:
        return declared
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        return "float32"
    with open(files[0], "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    kinds = [v["dtype"] for k, v in header.items() if k != "__metadata__"]
    return _SAFETENSORS_DTYPES.get(kinds[0], "float32") if kinds else "float32"


def choose_dtype(path: str, device: str, cpu_isa: str = "auto", dummy_config: str | None = None) -> DtypeChoice:
    """The dtype ``--dtype auto`` runs ``path`` in on ``device`` (imports torch); ``dummy_config``:
    the config.json of a model with random weights, whose declared dtype counts (else float32)."""
    found = (declared_dtype(dummy_config) or "float32") if dummy_config else checkpoint_dtype(path)
    if found == "quantized":
        return DtypeChoice("float32", "a quantised GGUF is dequantised to float32")
    if found == "float32":
        return DtypeChoice("float32", "the checkpoint's dtype")
    if device == "cpu":
        if found == "float16":
            return DtypeChoice("float32", "a float16 checkpoint on a CPU (its kernels compute in float32 or bfloat16)")
        from kvhive.model import cpu

        features = cpu.detect()
        if features.bf16_packing(features.level(cpu_isa)):
            return DtypeChoice("bfloat16", "the checkpoint's dtype (this CPU has fast bfloat16 matmuls)")
        return DtypeChoice("float32", "a bfloat16 checkpoint on a CPU without fast bfloat16 matmuls")
    import torch

    if found == "bfloat16" and not torch.cuda.is_bf16_supported():
        return DtypeChoice("float16", "a bfloat16 checkpoint on a GPU without bfloat16")
    return DtypeChoice(found, "the checkpoint's dtype")


def resolve_hub_model(repo_id: str, cache_dir: str | None = None) -> str:
    """The local path of Hugging Face repo ``repo_id`` from the HF cache, never from the network:
    its snapshot directory when it has a config.json, else its one .gguf file (ValueError naming
    the id when the cache lacks it or the snapshot is ambiguous)."""
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(parts) or repo_id.startswith((".", "~")):
        raise ValueError(f"--model: {repo_id} does not exist (a file, a directory or a Hugging Face repo id)")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ValueError(f"--model: {repo_id} does not exist, and huggingface_hub (to look it up in the "
                         "Hugging Face cache) is not installed") from None
    try:
        path = snapshot_download(repo_id, cache_dir=cache_dir, local_files_only=True)
    except Exception:      # huggingface_hub's not-cached and bad-id errors
        raise ValueError(f"--model: {repo_id} is neither a local path nor a Hugging Face repo in the local "
                         f"cache; download it first (huggingface-cli download {repo_id})") from None
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
    if len(ggufs) == 1:
        return ggufs[0]
    raise ValueError(f"--model: the cached snapshot of {repo_id} ({path}) has no config.json and "
                     f"{len(ggufs)} .gguf files; pass the file's path to --model")
