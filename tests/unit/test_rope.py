"""RoPE scaling read from config.json and GGUF metadata gives transformers' own frequencies and
attention factor; every unsupported variant is refused with the field named."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.families import llama3_rope_freqs
from support.tiny import tiny_config

from kvhive.config import RopeScaling
from kvhive.model.rope import (
    inverse_frequencies,
    rope_from_gguf,
    rope_from_hf,
    rope_tables,
    unread_gguf_rope_keys,
)

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

HEAD_DIM = 128
MAX_POS = 4096

VARIANTS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    "yarn_betas_mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048,
                          "beta_fast": 16, "beta_slow": 2, "mscale": 0.707, "mscale_all_dim": 1.0},
    "yarn_attention_factor_untruncated": {"rope_type": "yarn", "factor": 3.0, "attention_factor": 1.25,
                                          "original_max_position_embeddings": 1024, "truncate": False},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 512},
    "llama3_old_key": {"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 1024},
}


def _raw(rope: dict | None, key: str = "rope_scaling", theta: float = 500000.0) -> dict:
    raw = {"num_attention_heads": 8, "hidden_size": 8 * HEAD_DIM, "max_position_embeddings": MAX_POS,
           "rope_theta": theta}
    if rope is not None:
        raw[key] = rope
    return raw


def _transformers(rope: dict, theta: float = 500000.0) -> tuple[torch.Tensor, float]:
    config = transformers.LlamaConfig(hidden_size=8 * HEAD_DIM, num_attention_heads=8,
                                      max_position_embeddings=MAX_POS,
                                      rope_parameters={**rope, "rope_theta": theta})
    kind = config.rope_parameters["rope_type"]
    return ROPE_INIT_FUNCTIONS[kind](config, "cpu")


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_frequencies_equal_transformers(name: str, key: str) -> None:
    rope = VARIANTS[name]
    spec = rope_from_hf(_raw(dict(rope), key), HEAD_DIM, MAX_POS)
    theirs, attention = _transformers(dict(rope))
    ours = inverse_frequencies(spec.scaling, HEAD_DIM, spec.theta)
    torch.testing.assert_close(ours, theirs.float(), rtol=0, atol=0)
    assert spec.scaling.attention_factor == pytest.approx(attention, rel=1e-12)
    assert spec.scaling.kind == rope.get("rope_type", rope.get("type"))


def test_default_frequencies_and_theta() -> None:
    spec = rope_from_hf(_raw(None, theta=10000.0), HEAD_DIM, MAX_POS)
    assert spec.scaling == RopeScaling() and spec.theta == 10000.0 and spec.max_positions == MAX_POS
    plain = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    torch.testing.assert_close(inverse_frequencies(spec.scaling, HEAD_DIM, spec.theta), plain, rtol=0, atol=0)
    # transformers 5 puts rope_theta inside rope_parameters.
    inner = rope_from_hf({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, HEAD_DIM, MAX_POS)
    assert inner.theta == 1e6


def test_yarn_serves_original_length_times_factor() -> None:
    spec = rope_from_hf(_raw(dict(VARIANTS["yarn"])), HEAD_DIM, MAX_POS)
    assert spec.max_positions == 4096                       # max(4096, 1024 * 4)
    longer = rope_from_hf(_raw({"rope_type": "yarn", "factor": 8.0,
                                "original_max_position_embeddings": 1024}), HEAD_DIM, MAX_POS)
    assert longer.max_positions == 8192
    assert rope_from_hf(_raw(dict(VARIANTS["dynamic"])), HEAD_DIM, MAX_POS).max_positions == MAX_POS


def test_top_level_original_max_positions_wins() -> None:
    """Phi-3 keeps original_max_position_embeddings beside rope_scaling; transformers prefers it."""
    raw = _raw({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024})
    raw["original_max_position_embeddings"] = 2048
    assert rope_from_hf(raw, HEAD_DIM, MAX_POS).scaling.original_max_position_embeddings == 2048


def test_gguf_rope_freqs_give_the_llama3_frequencies() -> None:
    """llama.cpp's converter formula for rope_freqs, applied as divisors, equals transformers' llama3."""
    rope = VARIANTS["llama3"]
    factors = llama3_rope_freqs({**rope, "rope_theta": 500000.0}, HEAD_DIM)
    meta = {"llama.rope.freq_base": 500000.0, "llama.rope.dimension_count": HEAD_DIM}
    spec = rope_from_gguf(meta.get, "llama", HEAD_DIM, MAX_POS, factors, "m.gguf")
    theirs, _ = _transformers(dict(rope))
    torch.testing.assert_close(inverse_frequencies(spec.scaling, HEAD_DIM, spec.theta), theirs, rtol=1e-6, atol=0)


@pytest.mark.parametrize("kind", ["linear", "yarn"])
def test_gguf_metadata_scaling_equals_config_json(kind: str) -> None:
    meta = {"qwen2.rope.freq_base": 500000.0, "qwen2.rope.scaling.type": kind, "qwen2.rope.scaling.factor": 4.0,
            "qwen2.rope.scaling.original_context_length": 1024}
    from_gguf = rope_from_gguf(meta.get, "qwen2", HEAD_DIM, MAX_POS, None, "m.gguf")
    rope = dict(VARIANTS[kind])
    from_hf = rope_from_hf(_raw(rope), HEAD_DIM, MAX_POS)
    assert from_gguf == from_hf


def test_tables_scale_cos_and_sin_by_the_attention_factor() -> None:
    scaling = rope_from_hf(_raw(dict(VARIANTS["yarn"])), 16, MAX_POS).scaling
    config = tiny_config(rope_scaling=scaling, max_position_embeddings=64)
    cos, sin = rope_tables(config, torch.float32, "cpu")
    assert cos.shape == sin.shape == (64, 16)
    assert float(cos[0, 0]) == pytest.approx(scaling.attention_factor) and scaling.attention_factor > 1
    plain_cos, _ = rope_tables(tiny_config(max_position_embeddings=64), torch.float32, "cpu")
    assert float(plain_cos[0, 0]) == 1.0


@pytest.mark.parametrize(("raw", "field"), [
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}}, "rope_scaling.rope_type"),
    ({"rope_scaling": {"type": "su", "short_factor": [1.0]}}, "rope_scaling.rope_type 'su'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "alpha": 2}}, "rope_parameters.alpha"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1}}, "rope_scaling.low_freq_factor"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.low_freq_factor"),
    ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling.factor"),
    ({"partial_rotary_factor": 0.75}, "partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "default"}}},
     "rope_parameters per layer type"),
])
def test_unsupported_config_rope_is_refused_by_field(raw: dict, field: str) -> None:
    with pytest.raises(ValueError, match="config.json: .*" + field.replace(".", r"\.")):
        rope_from_hf({"rope_theta": 10000.0, **raw}, HEAD_DIM, MAX_POS, where="config.json")


@pytest.mark.parametrize(("meta", "field"), [
    ({"llama.rope.scaling.type": "longrope"}, "llama.rope.scaling.type"),
    ({"llama.rope.dimension_count": 64}, "llama.rope.dimension_count"),
])
def test_unsupported_gguf_rope_is_refused_by_field(meta: dict, field: str) -> None:
    with pytest.raises(ValueError, match="m.gguf: " + field.replace(".", r"\.")):
        rope_from_gguf(meta.get, "llama", HEAD_DIM, MAX_POS, None, "m.gguf")


def test_gguf_rope_freqs_with_metadata_scaling_is_refused() -> None:
    meta = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0}
    with pytest.raises(ValueError, match="rope_freqs"):
        rope_from_gguf(meta.get, "llama", HEAD_DIM, MAX_POS, np.ones(HEAD_DIM // 2, np.float32), "m.gguf")
    with pytest.raises(ValueError, match="rope_freqs.weight has shape"):
        rope_from_gguf({}.get, "llama", HEAD_DIM, MAX_POS, np.ones(3, np.float32), "m.gguf")


def test_unread_gguf_rope_keys_are_listed() -> None:
    keys = ["llama.rope.freq_base", "llama.rope.scaling.yarn_log_multiplier", "llama.context_length",
            "llama.rope.freq_base_swa"]
    assert unread_gguf_rope_keys(keys, "llama") == ["llama.rope.scaling.yarn_log_multiplier",
                                                    "llama.rope.freq_base_swa"]
