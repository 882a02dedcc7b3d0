"""What a checkpoint reader hands the loader, and the checks every checkpoint passes before it loads.

A reader (``hf_dir``, ``gguf_file``) turns files into a ``Checkpoint``: the model config, float
tensors under Hugging Face names, the file each tensor came from, and a digest of the files.
``check_tensors`` then compares every tensor's shape with what the config implies, so a config
that disagrees with its weights is an error naming the file, the tensor and the config fields,
never a crash inside the model or a model that silently runs on the wrong shapes.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from typing import NamedTuple

import torch

from kvhive.config import ModelConfig

_SAMPLE_BYTES = 1 << 20      # bytes hashed from each end of a weight file for the fingerprint
# Tensors some checkpoints carry that no model reads (precomputed rotary buffers of old exports).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class Checkpoint(NamedTuple):
    """A read checkpoint: config, float tensors (HF names), their files, a digest of the files."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    sources: dict[str, str]
    qkv_bias: bool
    digest: bytes


class Fields(NamedTuple):
    """The names a checkpoint's config gives the sizes (config.json keys or GGUF metadata keys)."""

    vocab: str = "vocab_size"
    hidden: str = "hidden_size"
    heads: str = "num_attention_heads"
    kv_heads: str = "num_key_value_heads"
    head_dim: str = "head_dim"
    inter: str = "intermediate_size"
    layers: str = "num_hidden_layers"


def expected_shapes(c: ModelConfig, qkv_bias: bool, f: Fields) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor the model loads: its shape and the config fields that set it."""
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    q_f, kv_f = f"{f.heads} x {f.head_dim}", f"{f.kv_heads} x {f.head_dim}"
    shapes = {"model.embed_tokens.weight": ((c.vocab_size, c.hidden_size), f"{f.vocab}, {f.hidden}"),
              "model.norm.weight": ((c.hidden_size,), f.hidden)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = ((c.vocab_size, c.hidden_size), f"{f.vocab}, {f.hidden}")
    layer = {"input_layernorm.weight": ((c.hidden_size,), f.hidden),
             "post_attention_layernorm.weight": ((c.hidden_size,), f.hidden),
             "self_attn.q_proj.weight": ((q, c.hidden_size), f"{q_f}, {f.hidden}"),
             "self_attn.k_proj.weight": ((kv, c.hidden_size), f"{kv_f}, {f.hidden}"),
             "self_attn.v_proj.weight": ((kv, c.hidden_size), f"{kv_f}, {f.hidden}"),
             "self_attn.o_proj.weight": ((c.hidden_size, q), f"{f.hidden}, {q_f}"),
             "mlp.gate_proj.weight": ((c.intermediate_size, c.hidden_size), f"{f.inter}, {f.hidden}"),
             "mlp.up_proj.weight": ((c.intermediate_size, c.hidden_size), f"{f.inter}, {f.hidden}"),
             "mlp.down_proj.weight": ((c.hidden_size, c.intermediate_size), f"{f.hidden}, {f.inter}")}
    if qkv_bias:
        layer.update({"self_attn.q_proj.bias": ((q,), q_f), "self_attn.k_proj.bias": ((kv,), kv_f),
                      "self_attn.v_proj.bias": ((kv,), kv_f)})
    if c.gemma is not None:
        layer.update({"pre_feedforward_layernorm.weight": ((c.hidden_size,), f.hidden),
                      "post_feedforward_layernorm.weight": ((c.hidden_size,), f.hidden)})
    if c.qk_norm:
        layer.update({"self_attn.q_norm.weight": ((c.head_dim,), f.head_dim),
                      "self_attn.k_norm.weight": ((c.head_dim,), f.head_dim)})
    for i in range(c.num_layers):
        shapes.update({f"model.layers.{i}.{name}": spec for name, spec in layer.items()})
    return shapes


def check_tensors(ckpt: Checkpoint, family: str, f: Fields) -> None:
    """ValueError naming the file, the tensor and the config fields when a tensor the model needs is
    missing, has another shape than the config implies, or is one the model would not read."""
    expected = expected_shapes(ckpt.config, ckpt.qkv_bias, f)
    for name, tensor in ckpt.weights.items():
        source = ckpt.sources.get(name, "checkpoint")
        if name not in expected:
            layer = name.split(".")[2] if name.startswith("model.layers.") else ""
            hint = (f" (past {f.layers} = {ckpt.config.num_layers})"
                    if layer.isdigit() and int(layer) >= ckpt.config.num_layers else "")
            raise ValueError(f"{source}: tensor {name} is not part of a {family} model as kvhive runs it{hint}")
        shape, fields = expected[name]
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{source}: tensor {name} has shape {list(tensor.shape)}, but the config "
                             f"({fields}) gives {list(shape)}")
    missing = [n for n in expected if n not in ckpt.weights]
    if missing:
        where = next(iter(ckpt.sources.values()), "checkpoint")
        raise ValueError(f"{where}: the checkpoint lacks {len(missing)} tensors the config ({f.layers} = "
                         f"{ckpt.config.num_layers}) implies, e.g. {missing[:3]}")


def drop_ignored(weights: dict[str, torch.Tensor]) -> None:
    """Remove tensors no model reads (``_IGNORED_SUFFIXES``), in place."""
    for name in [n for n in weights if n.endswith(_IGNORED_SUFFIXES)]:
        del weights[name]


def file_digest(path: str, header_bytes: int = 0) -> bytes:
    """Digest of a file's size, its first header_bytes, and _SAMPLE_BYTES from each end of the rest."""
    size = os.path.getsize(path)
    h = hashlib.blake2b(str(size).encode(), digest_size=16)
    with open(path, "rb") as f:
        h.update(f.read(header_bytes + _SAMPLE_BYTES))
        f.seek(max(0, size - _SAMPLE_BYTES))
        h.update(f.read(_SAMPLE_BYTES))
    return h.digest()


def first_of(mapping: Mapping[str, object], *keys: str) -> object:
    """The value of the first key present (not None) in ``mapping``, else None."""
    for key in keys:
        if mapping.get(key) is not None:
            return mapping[key]
    return None
