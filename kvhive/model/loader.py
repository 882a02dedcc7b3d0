"""Load a model from a GGUF file or a Hugging Face directory (config.json + safetensors).

The readers (``gguf_file``, ``hf_dir``) produce a checked ``Checkpoint``: the config and float
tensors under Hugging Face names, which ``LlamaModel.load_hf_weights`` fuses into its QKV and
gate/up projections. Which families run and how their checkpoints differ is ``families``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass

import torch

from kvhive.config import LOAD_FORMATS, ModelConfig, RopeScaling
from kvhive.model.checkpoint import Checkpoint
from kvhive.model.dummy_weights import dummy_digest, init_dummy_weights, read_dummy_config
from kvhive.model.gemma import GemmaModel
from kvhive.model.gguf_file import read_gguf
from kvhive.model.hf_dir import read_hf_dir
from kvhive.model.llama import LlamaModel
from kvhive.model.quant import QuantWeight


@dataclass(frozen=True)
class LoadedModel:
    """A ready model, its config, and a stable fingerprint of architecture + weights."""

    config: ModelConfig
    model: LlamaModel | GemmaModel
    fingerprint: str


def read_checkpoint(path: str | os.PathLike[str], quantized: dict[str, QuantWeight] | None = None,
                    hf_config_path: str | None = None) -> Checkpoint:
    """The checked checkpoint at ``path`` (a .gguf file or a model directory, whose config may come
    from ``hf_config_path`` instead); ValueError naming the file and field of anything kvhive
    cannot run exactly."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return read_hf_dir(path, hf_config_path)
    if path.endswith(".gguf") and os.path.isfile(path):
        if hf_config_path is not None:
            raise ValueError(f"--hf-config-path applies to Hugging Face directories and --load-format dummy; "
                             f"{path} is a GGUF file, whose config is its metadata")
        return read_gguf(path, quantized)
    raise ValueError(f"model path {path!r} is neither a .gguf file nor a model directory")


def load_model(path: str | os.PathLike[str], dtype: str = "float32", device: str = "cpu",
               pack_weights: bool = True, quantized_matmul: bool = True, isa: str | None = None,
               load_format: str = "auto", hf_config_path: str | None = None, seed: int = 0) -> LoadedModel:
    """Load a GGUF file or a Hugging Face model directory (weights packed for oneDNN on CPU).

    ``quantized_matmul``: on CPU, also keep a GGUF file's Q4_1/Q8_0 blocks so that steps with few
    rows (decode) multiply by them directly (see ``kvhive.model.quant``). ``isa``: the CPU ISA
    level of the C++ kernels (``kvhive.model.cpu``; None: the CPU's best). ``load_format``:
    ``auto`` reads the weights, ``dummy`` draws them (``seed``) for the config alone
    (``kvhive.model.dummy_weights``). ``hf_config_path``: a config.json (or its directory) read
    instead of the model directory's.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"--load-format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    if load_format == "dummy":
        return _dummy_model(os.fspath(path), hf_config_path, dtype, device, pack_weights, isa, seed)
    quantized: dict[str, QuantWeight] = {}
    keep = quantized_matmul and torch.device(device).type == "cpu"
    ckpt = read_checkpoint(path, quantized if keep else None, hf_config_path)
    model = _empty_model(ckpt.config, ckpt.qkv_bias, dtype, device, isa)
    model.load_hf_weights(ckpt.weights)
    if quantized:
        model.attach_quantized(quantized)
    if pack_weights:
        model.pack_weights()
    model.eval()
    return LoadedModel(config=ckpt.config, model=model, fingerprint=_fingerprint(ckpt.config, ckpt.digest))


def _empty_model(config: ModelConfig, qkv_bias: bool, dtype: str, device: str,
                 isa: str | None) -> LlamaModel | GemmaModel:
    """The model class ``config`` runs in, its parameters allocated (not filled) on ``device``."""
    if config.gemma is not None:
        return GemmaModel(config, dtype=dtype, device=device)
    return LlamaModel(config, dtype=dtype, device=device, qkv_bias=qkv_bias, isa=isa)


def _dummy_model(path: str, hf_config_path: str | None, dtype: str, device: str, pack_weights: bool,
                 isa: str | None, seed: int) -> LoadedModel:
    """A model of the config at ``path`` (or ``hf_config_path``) with random weights drawn on
    ``device``; its fingerprint starts with "dummy-" (never a checkpoint's)."""
    dummy = read_dummy_config(path, hf_config_path)
    model = _empty_model(dummy.config, dummy.qkv_bias, dtype, device, isa)
    init_dummy_weights(model, seed)
    if pack_weights:
        model.pack_weights()
    model.eval()
    return LoadedModel(config=dummy.config, model=model,
                       fingerprint="dummy-" + _fingerprint(dummy.config, dummy_digest(seed)))


def _fingerprint(config: ModelConfig, weights_digest: bytes) -> str:
    """16 hex digits from the architecture config and the weights' digest (no paths, no process state).

    The variant fields (RoPE scaling, q/k norm) enter only when set, so a plain Llama-family
    config hashes as its sizes alone.
    """
    fields = dataclasses.asdict(config)
    if config.rope_scaling == RopeScaling():
        del fields["rope_scaling"]
    if not config.qk_norm:
        del fields["qk_norm"]
    if config.gemma is None:
        del fields["gemma"]
    h = hashlib.blake2b(digest_size=8)
    h.update(json.dumps(fields, sort_keys=True).encode())
    h.update(weights_digest)
    return h.hexdigest()
