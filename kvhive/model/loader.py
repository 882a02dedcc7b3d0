"""Load a Llama-family model from a GGUF file or a Hugging Face directory (config.json + safetensors).

Both paths produce Hugging Face-named float tensors and hand them to ``LlamaModel.load_hf_weights``,
which fuses QKV and gate/up. GGUF tensors are dequantised with ``gguf.quants.dequantize`` and
llama.cpp's Q/K row permutation is undone, so both paths use the same rotate-half RoPE.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from kvhive.config import ModelConfig
from kvhive.model.llama import LlamaModel
from kvhive.model.quant import KINDS as QUANT_KINDS
from kvhive.model.quant import QuantWeight

# Architectures whose GGUF converter permutes attn_q / attn_k rows (llama.cpp's rotary layout).
_PERMUTED_QK_ARCHS = {"llama", "mistral"}
_SUPPORTED_ARCHS = {"llama", "mistral", "qwen2"}
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_SAMPLE_BYTES = 1 << 20      # bytes hashed from each end of a weight file for the fingerprint


@dataclass(frozen=True)
class LoadedModel:
    """A ready model, its config, and a stable fingerprint of architecture + weights."""

    config: ModelConfig
    model: LlamaModel
    fingerprint: str


def load_model(path: str | os.PathLike[str], dtype: str = "float32", device: str = "cpu",
               pack_weights: bool = True, quantized_matmul: bool = True, isa: str | None = None) -> LoadedModel:
    """Load a GGUF file or a Hugging Face model directory (weights packed for oneDNN on CPU).

    ``quantized_matmul``: on CPU, also keep a GGUF file's Q4_1/Q8_0 blocks so that steps with few
    rows (decode) multiply by them directly (see ``kvhive.model.quant``). ``isa``: the CPU ISA
    level of the C++ kernels (``kvhive.model.cpu``; None: the CPU's best).
    """
    path = os.fspath(path)
    quantized: dict[str, QuantWeight] = {}
    if os.path.isdir(path):
        config, weights, qkv_bias, digest = _read_hf_dir(path)
    elif path.endswith(".gguf") and os.path.isfile(path):
        keep = quantized_matmul and torch.device(device).type == "cpu"
        config, weights, qkv_bias, digest = _read_gguf(path, quantized if keep else None)
    else:
        raise ValueError(f"model path {path!r} is neither a .gguf file nor a model directory")
    model = LlamaModel(config, dtype=dtype, device=device, qkv_bias=qkv_bias, isa=isa)
    model.load_hf_weights(weights)
    del weights
    if quantized:
        model.attach_quantized(quantized)
    if pack_weights:
        model.pack_weights()
    model.eval()
    return LoadedModel(config=config, model=model, fingerprint=_fingerprint(config, digest))


def _fingerprint(config: ModelConfig, weights_digest: bytes) -> str:
    """16 hex digits from the architecture config and the weights' digest (no paths, no process state)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(json.dumps(dataclasses.asdict(config), sort_keys=True).encode())
    h.update(weights_digest)
    return h.hexdigest()


def _file_digest(path: str, header_bytes: int = 0) -> bytes:
    """Digest of a file's size, its first header_bytes, and _SAMPLE_BYTES from each end of the rest."""
    size = os.path.getsize(path)
    h = hashlib.blake2b(str(size).encode(), digest_size=16)
    with open(path, "rb") as f:
        h.update(f.read(header_bytes + _SAMPLE_BYTES))
        f.seek(max(0, size - _SAMPLE_BYTES))
        h.update(f.read(_SAMPLE_BYTES))
    return h.digest()


# ---------------------------------------------------------------------------------------- GGUF


def _fast_gguf_reader(path: str):  # noqa: ANN202 - returns a gguf.GGUFReader
    """gguf.GGUFReader, parsing metadata from a plain ndarray view (3x faster than through np.memmap)."""
    import gguf

    class _Reader(gguf.GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):  # noqa: ANN001, ANN202
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
            itemsize = np.dtype(dtype).itemsize
            arr = plain[offset:offset + itemsize * int(count)].view(dtype)[:int(count)]
            order = self.byte_order if override_order is None else override_order
            return arr.view(arr.dtype.newbyteorder(order))

    try:
        return _Reader(path)
    except Exception:                      # a gguf version whose internals differ: the plain reader
        return gguf.GGUFReader(path)


def _read_gguf(path: str, quantized: dict[str, QuantWeight] | None = None,
               ) -> tuple[ModelConfig, dict[str, torch.Tensor], bool, bytes]:
    """Config, dequantised float32 weights (HF names), qkv-bias flag, digest.

    With ``quantized`` given, Q4_1/Q8_0 matrices are also put there as their GGUF blocks.
    """
    reader = _fast_gguf_reader(path)
    arch, config = _gguf_config(reader, path)
    weights = _gguf_weights(reader, arch, config, quantized)
    digest = _file_digest(path, header_bytes=reader.data_offset)
    return config, weights, "model.layers.0.self_attn.q_proj.bias" in weights, digest


def _gguf_config(reader, path: str) -> tuple[str, ModelConfig]:
    """The GGUF's architecture and model config; ValueError for an architecture or RoPE scaling
    kvhive does not run."""
    def field(key: str, default: object = None) -> object:
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = str(field("general.architecture"))
    if arch not in _SUPPORTED_ARCHS:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}")
    scaling = field(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ValueError(f"{path}: RoPE scaling {scaling!r} is not supported")
    tensors = {t.name: t for t in reader.tensors}
    heads = int(field(f"{arch}.attention.head_count"))
    hidden = int(field(f"{arch}.embedding_length"))
    eos = [field("tokenizer.ggml.eos_token_id"), field("tokenizer.ggml.eot_token_id")]
    bos = field("tokenizer.ggml.bos_token_id")
    return arch, ModelConfig(
        vocab_size=int(tensors["token_embd.weight"].shape[1]),
        hidden_size=hidden,
        intermediate_size=int(field(f"{arch}.feed_forward_length")),
        num_layers=int(field(f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(field(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(field(f"{arch}.attention.key_length", hidden // heads)),
        rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(field(f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
    )


def _gguf_weights(reader, arch: str, config: ModelConfig,
                  quantized: dict[str, QuantWeight] | None) -> dict[str, torch.Tensor]:
    """The GGUF's tensors dequantised to float32 under HF names, llama.cpp's Q/K row permutation
    undone; Q4_1/Q8_0 matrices also put in ``quantized`` (when given) as their blocks."""
    from gguf.quants import dequantize

    weights: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name, hf_name = t.name, _gguf_to_hf_name(t.name)
        if hf_name is None:
            continue
        shape = [int(d) for d in reversed(t.shape)]
        arr = dequantize(t.data, t.tensor_type).reshape(shape)
        permuted = arch in _PERMUTED_QK_ARCHS and name.endswith(("attn_q.weight", "attn_k.weight"))
        heads = config.num_heads if "attn_q" in name else config.num_kv_heads
        if permuted:
            arr = _unpermute_rows(arr, heads)
        if quantized is not None and t.tensor_type.name in QUANT_KINDS and len(shape) == 2:
            qw = QuantWeight.from_gguf(t.tensor_type.name, t.data, *shape)
            if permuted:
                qw = qw.take_rows(_unpermute_rows(np.arange(shape[0])[:, None], heads)[:, 0])
            quantized[hf_name] = qw
        if not arr.flags.writeable:            # F32 tensors are views of the read-only file map
            arr = arr.copy()
        weights[hf_name] = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))
    return weights


def _gguf_to_hf_name(name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None for unused tensors."""
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}"
    if name.startswith("rope_"):          # precomputed rope factors: not used by supported models
        return None
    raise ValueError(f"unexpected GGUF tensor {name!r}")


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of Q/K (as transformers' GGUF loader does)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ------------------------------------------------------------------------------- HF directory


def _read_hf_dir(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor], bool, bytes]:
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    model_type = raw.get("model_type")
    if model_type not in _SUPPORTED_ARCHS:
        raise ValueError(f"{path}: unsupported model_type {model_type!r}")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"{path}: RoPE scaling {rope!r} is not supported")
    eos = raw.get("eos_token_id")
    heads = int(raw["num_attention_heads"])
    max_positions = int(raw.get("max_position_embeddings", 2048))
    window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
    if window:                      # full attention is exact only up to the window
        max_positions = min(max_positions, int(window))
    config = ModelConfig(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
        rope_theta=float(raw.get("rope_theta", rope.get("rope_theta", 10000.0))),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
    )
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    digest = hashlib.blake2b(digest_size=16)
    for file in _safetensors_files(path):
        weights.update(load_file(file))
        with open(file, "rb") as f:
            header_len = 8 + int.from_bytes(f.read(8), "little")
        digest.update(_file_digest(file, header_bytes=header_len))
    if "model.layers.0.self_attn.o_proj.bias" in weights:
        raise ValueError(f"{path}: an o_proj bias is not supported")
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    return config, weights, "model.layers.0.self_attn.q_proj.bias" in weights, digest.digest()


def _safetensors_files(path: str) -> Iterator[str]:
    """model.safetensors, or the shards an index names, in a stable order."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        yield from (os.path.join(path, s) for s in shards)
        return
    single = os.path.join(path, "model.safetensors")
    if not os.path.exists(single):
        raise ValueError(f"{path}: no model.safetensors or model.safetensors.index.json")
    yield single
