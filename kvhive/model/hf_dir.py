"""Read a Hugging Face model directory: config.json and safetensors (one file or index + shards).

Float32, bfloat16 and float16 files load alike (the model casts to its dtype). A directory that
cannot be read right is a ``ValueError`` naming the file and the field: config.json missing or
not JSON, a required key missing, a shard the index names but the directory lacks, a truncated
or corrupt safetensors file, a tensor the index places in a shard that lacks it, and (through
``checkpoint.check_tensors``) weights whose shapes disagree with the config.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping

import torch

from kvhive.config import ModelConfig
from kvhive.model.checkpoint import Checkpoint, Fields, check_tensors, drop_ignored, file_digest
from kvhive.model.families import (
    Family,
    check_architectures,
    check_graph_keys,
    family_for_model_type,
    fused_name,
    split_fused,
)
from kvhive.model.gemma_config import gemma_rope_raw, gemma_spec
from kvhive.model.rope import rope_from_hf

_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
INDEX_FILE = "model.safetensors.index.json"


def config_json_file(path: str) -> str:
    """The config.json a path names: the file itself, or a model directory's config.json."""
    return path if os.path.isfile(path) else os.path.join(path, "config.json")


def read_config_json(path: str) -> dict[str, object]:
    """The config.json of a model directory (or the JSON file ``path`` itself) as a dict
    (ValueError naming the file when unreadable)."""
    file = config_json_file(path)
    try:
        with open(file) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path}: no config.json (a Hugging Face model directory has one)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:   # Recursion: nesting
        raise ValueError(f"{file}: not readable JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{file}: expected a JSON object")
    return raw


def read_hf_config(path: str) -> tuple[ModelConfig, Family]:
    """The checked ModelConfig and family of the config.json ``path`` names (a directory or the
    file); ValueError naming the file and the field of anything kvhive cannot run."""
    where = config_json_file(path)
    raw = read_config_json(path)
    check_architectures(raw, where)
    family = family_for_model_type(raw.get("model_type"), where)
    check_graph_keys(raw, where, family)
    return hf_model_config(raw, family, where), family


def read_hf_dir(path: str, config_path: str | None = None) -> Checkpoint:
    """The directory's config, tensors (fused Phi-3 projections split), sources and digest, checked.

    ``config_path``: read the config from this config.json (or directory) instead of the
    model directory's (``--hf-config-path``); the tensors are checked against it all the same.
    """
    config, family = read_hf_config(config_path or path)
    weights, sources, digest = _read_safetensors(path)
    drop_ignored(weights)
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    if family.fused_projections:
        q_rows, kv_rows = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        split_fused(weights, config.num_layers, q_rows, kv_rows)
    for name in weights:
        sources.setdefault(name, sources.get(fused_name(name), path))
    ckpt = Checkpoint(config, weights, sources, "model.layers.0.self_attn.q_proj.bias" in weights, digest)
    check_tensors(ckpt, family.model_type, Fields())
    return ckpt


def _int(raw: Mapping[str, object], key: str, where: str, default: object = None) -> int:
    """An integer config key (ValueError naming it when missing or not an integer)."""
    value = raw.get(key, default)
    if value is None:
        raise ValueError(f"{where}: {key} is missing")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise ValueError(f"{where}: {key} must be an integer, got {value!r}")
    return int(value)


def hf_model_config(raw: Mapping[str, object], family: Family, where: str) -> ModelConfig:
    """ModelConfig of a config.json, with transformers' defaults for the family where keys are absent."""
    merged = {**family.defaults, **{k: v for k, v in raw.items() if v is not None}}
    sizes = {key: _int(merged, key, where) for key in _REQUIRED}
    heads = sizes["num_attention_heads"]
    head_dim = _int(merged, "head_dim", where, sizes["hidden_size"] // heads)
    max_positions = _int(merged, "max_position_embeddings", where, 2048)
    rope_raw, local_theta = gemma_rope_raw(raw, family.defaults, where) if family.gemma else (raw, None)
    rope = rope_from_hf(rope_raw, head_dim, max_positions, where)
    # Gemma attends to its windows exactly; other families' windows bound the served length.
    gemma = gemma_spec({**family.defaults, **raw}, sizes["num_hidden_layers"], local_theta, where) if family.gemma else None
    window = merged.get("sliding_window") if merged.get("use_sliding_window", True) and not gemma else None
    served = rope.max_positions
    if window:                      # full attention is exact only up to the window
        served = min(served, _int(merged, "sliding_window", where))
    eos = raw.get("eos_token_id")
    try:
        return ModelConfig(
            vocab_size=sizes["vocab_size"], hidden_size=sizes["hidden_size"],
            intermediate_size=sizes["intermediate_size"], num_layers=sizes["num_hidden_layers"],
            num_heads=heads, num_kv_heads=_int(merged, "num_key_value_heads", where, heads),
            head_dim=head_dim, rope_theta=rope.theta, rope_scaling=rope.scaling,
            rms_norm_eps=float(merged.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=served,
            tie_word_embeddings=bool(merged.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
            qk_norm=family.qk_norm, gemma=gemma,
        )
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _read_safetensors(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str], bytes]:
    """All tensors of the directory's safetensors files, the file of each, and a digest of the files."""
    from safetensors import safe_open

    weights: dict[str, torch.Tensor] = {}
    sources: dict[str, str] = {}
    digest = hashlib.blake2b(digest_size=16)
    placed = _index_weight_map(path)
    for file in _safetensors_files(path, placed):
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():            # noqa: SIM118 - safe_open has no __iter__
                    weights[name] = f.get_tensor(name)
                    sources[name] = file
            with open(file, "rb") as f:
                header_len = 8 + int.from_bytes(f.read(8), "little")
        except Exception as exc:            # safetensors raises its own error types for bad files
            raise ValueError(f"{file}: not a readable safetensors file, truncated or corrupt ({exc})") from None
        digest.update(file_digest(file, header_bytes=header_len))
    for name, shard in placed.items():
        if name not in weights:
            raise ValueError(f"{os.path.join(path, shard)}: lacks tensor {name}, which {INDEX_FILE} places there")
    return weights, sources, digest.digest()


def _index_weight_map(path: str) -> dict[str, str]:
    """The index's tensor -> shard map; empty for a single-file checkpoint."""
    index = os.path.join(path, INDEX_FILE)
    if not os.path.exists(index):
        return {}
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{index}: not a readable safetensors index, no weight_map ({exc!r})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index}: weight_map must map tensor names to shard file names")
    return weight_map


def _safetensors_files(path: str, weight_map: Mapping[str, str]) -> Iterator[str]:
    """model.safetensors, or the shards the index names, in a stable order (ValueError for a missing one)."""
    if weight_map:
        for shard in sorted(set(weight_map.values())):
            file = os.path.join(path, shard)
            if not os.path.isfile(file):
                raise ValueError(f"{file}: missing shard (named in {os.path.join(path, INDEX_FILE)})")
            yield file
        return
    single = os.path.join(path, "model.safetensors")
    if not os.path.exists(single):
        raise ValueError(f"{path}: no model.safetensors or {INDEX_FILE}")
    yield single
