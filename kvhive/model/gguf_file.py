"""Read a GGUF file (llama.cpp's format) into a ``Checkpoint`` under Hugging Face tensor names.

Tensors are dequantised with ``gguf.quants.dequantize``; llama.cpp's Q/K row interleave (its
converter permutes Llama and Mistral so that its own RoPE pairs adjacent values) is undone, so
every family runs the same rotate-half RoPE. Phi-3's fused ``attn_qkv`` and ``ffn_up`` (gate and
up) are split. The ``rope_freqs`` tensor is llama.cpp's form of llama3 RoPE scaling
(``kvhive.model.rope``). Gemma's norms are stored with the 1 of ``1 + weight`` added, which the
reader takes off again (exact in float32). Any other ``rope_*`` tensor, any metadata key under ``{arch}.rope.`` the
RoPE reader does not read, and any tensor without a place in the model is an error, never ignored.
A truncated or corrupt file, or a required metadata key that is missing, is an error naming it.
"""

from __future__ import annotations

import numpy as np
import torch

from kvhive.config import ModelConfig
from kvhive.model.checkpoint import Checkpoint, Fields, check_tensors, file_digest
from kvhive.model.families import Family, family_for_gguf_arch, fused_name, split_fused
from kvhive.model.gemma_config import gguf_gemma_spec
from kvhive.model.quant import KINDS as QUANT_KINDS
from kvhive.model.quant import QuantWeight
from kvhive.model.rope import ROPE_FREQS_TENSOR, rope_from_gguf, unread_gguf_rope_keys

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma's four per-layer norms (llama.cpp's converter stores each with the 1 of ``1 + weight`` added).
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def gguf_reader(path: str):  # noqa: ANN202 - returns a gguf.GGUFReader
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
    except Exception:                      # a gguf version whose internals differ, or a bad file
        try:
            return gguf.GGUFReader(path)
        except Exception as exc:           # the gguf package raises several types for a bad file
            raise ValueError(f"{path}: not a readable GGUF file, truncated or corrupt ({exc})") from None


class _Meta:
    """A GGUF file's metadata: ``get`` (None when absent) and ``need`` (ValueError naming the key)."""

    def __init__(self, reader, path: str) -> None:  # noqa: ANN001 - a gguf.GGUFReader
        self.reader, self.path = reader, path

    def get(self, key: str) -> object:
        """The value of ``key``, or None when the file lacks it."""
        f = self.reader.fields.get(key)
        return None if f is None else f.contents()

    def need(self, key: str) -> int:
        """The integer value of ``key`` (ValueError naming it when missing or not an integer)."""
        value = self.get(key)
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise ValueError(f"{self.path}: GGUF metadata {key} is {'missing' if value is None else repr(value)}")
        return int(value)


def read_gguf(path: str, quantized: dict[str, QuantWeight] | None = None) -> Checkpoint:
    """Config, dequantised float32 weights (HF names), sources and digest, checked.

    With ``quantized`` given, Q4_1/Q8_0 matrices are also put there as their GGUF blocks.
    """
    reader = gguf_reader(path)
    meta = _Meta(reader, path)
    arch = str(meta.get("general.architecture"))
    family = family_for_gguf_arch(arch, path)
    unread = unread_gguf_rope_keys(list(reader.fields), arch)
    if unread:
        raise ValueError(f"{path}: GGUF metadata {unread[0]} is not supported")
    tensors = {t.name: t for t in reader.tensors}
    freqs = tensors.get(ROPE_FREQS_TENSOR)
    freq_factors = None if freqs is None else np.asarray(freqs.data, dtype=np.float32).reshape(-1)
    config = _config(meta, arch, family, tensors, freq_factors)
    weights, sources = _weights(reader, path, family, config, quantized)
    if family.fused_projections:
        split_fused(weights, config.num_layers, config.num_heads * config.head_dim,
                    config.num_kv_heads * config.head_dim)
    for name in weights:
        sources.setdefault(name, sources.get(fused_name(name), path))
    digest = file_digest(path, header_bytes=reader.data_offset)
    ckpt = Checkpoint(config, weights, sources,
                      "model.layers.0.self_attn.q_proj.bias" in weights, digest)
    check_tensors(ckpt, arch, _fields(arch))
    return ckpt


def _fields(arch: str) -> Fields:
    """The GGUF metadata keys that give the model's sizes."""
    return Fields(vocab="token_embd.weight rows", hidden=f"{arch}.embedding_length",
                  heads=f"{arch}.attention.head_count", kv_heads=f"{arch}.attention.head_count_kv",
                  head_dim=f"{arch}.attention.key_length", inter=f"{arch}.feed_forward_length",
                  layers=f"{arch}.block_count")


def _config(meta: _Meta, arch: str, family: Family, tensors: dict, freq_factors: np.ndarray | None) -> ModelConfig:
    """The model config from the GGUF metadata (ValueError naming a missing or bad key)."""
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{meta.path}: no token_embd.weight tensor")
    heads, hidden = meta.need(f"{arch}.attention.head_count"), meta.need(f"{arch}.embedding_length")
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    context = int(meta.get(f"{arch}.context_length") or 2048)
    rope = rope_from_gguf(meta.get, arch, head_dim, context, freq_factors, meta.path)
    served = rope.max_positions
    num_layers = meta.need(f"{arch}.block_count")
    gemma = gguf_gemma_spec(meta.get, arch, num_layers, hidden, heads, head_dim, meta.path) if family.gemma else None
    window = None if gemma else meta.get(f"{arch}.attention.sliding_window")
    if window:                      # full attention is exact only up to the window (Gemma's is exact)
        served = min(served, int(window))
    eos = [meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")]
    bos = meta.get("tokenizer.ggml.bos_token_id")
    try:
        return ModelConfig(
            vocab_size=int(tensors["token_embd.weight"].shape[1]), hidden_size=hidden,
            intermediate_size=meta.need(f"{arch}.feed_forward_length"),
            num_layers=num_layers, num_heads=heads,
            num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads), head_dim=head_dim,
            rope_theta=rope.theta, rope_scaling=rope.scaling,
            rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon") or 1e-5),
            max_position_embeddings=served, tie_word_embeddings="output.weight" not in tensors,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
            qk_norm=family.qk_norm, gemma=gemma,
        )
    except ValueError as exc:
        raise ValueError(f"{meta.path}: {exc}") from None


def _weights(reader, path: str, family: Family, config: ModelConfig,  # noqa: ANN001 - a gguf.GGUFReader
             quantized: dict[str, QuantWeight] | None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The GGUF's tensors dequantised to float32 under HF names, llama.cpp's Q/K row permutation
    undone, and where each came from ("file: GGUF name"); Q4_1/Q8_0 matrices also put in
    ``quantized`` (when given) as their blocks."""
    from gguf.quants import dequantize

    weights: dict[str, torch.Tensor] = {}
    sources: dict[str, str] = {}
    for t in reader.tensors:
        name = t.name
        if name == ROPE_FREQS_TENSOR:      # read by _config into the RoPE scaling
            continue
        try:
            hf_name = hf_tensor_name(name, family)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        shape = [int(d) for d in reversed(t.shape)]
        try:
            arr = dequantize(t.data, t.tensor_type).reshape(shape)
        except (ValueError, NotImplementedError) as exc:
            raise ValueError(f"{path}: tensor {name} ({t.tensor_type.name}) cannot be read: {exc}") from None
        permuted = family.permuted_qk and name.endswith(("attn_q.weight", "attn_k.weight"))
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
        if family.gemma and name.endswith("norm.weight"):
            arr = arr - np.float32(1.0)         # exact in float32; GemmaModel adds the 1 back
        weights[hf_name] = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))
        sources[hf_name] = f"{path}: {name}"
    return weights, sources


def hf_tensor_name(name: str, family: Family) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (ValueError for a
    tensor without a place in the model, a ``rope_*`` one included)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    layer_names = _GEMMA_LAYER_NAMES if family.gemma else _LAYER_NAMES
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in layer_names:
        if family.fused_projections and parts[2] == "ffn_up.weight":    # Phi-3: gate and up rows
            return f"model.layers.{parts[1]}.mlp.gate_up_proj.weight"
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}"
    if name.startswith("rope_"):
        raise ValueError(f"GGUF tensor {name!r} (RoPE factors kvhive does not apply) is not supported")
    raise ValueError(f"unexpected GGUF tensor {name!r}")


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of Q/K (as transformers' GGUF loader does)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
