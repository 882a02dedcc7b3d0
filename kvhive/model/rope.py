"""Rotary position embeddings: a checkpoint's RoPE scaling, read and checked, and its cos/sin tables.

Five kinds run, each computed as transformers' ``modeling_rope_utils`` computes it (float32):
``default``; ``linear`` (every inverse frequency divided by ``factor``); ``dynamic`` (NTK, see
``served_positions``); ``yarn`` (interpolated and extrapolated frequencies blended over a ramp set
by ``beta_fast``/``beta_slow`` and ``original_max_position_embeddings``, cos and sin scaled by
the attention factor, ``0.1 ln(factor) + 1`` unless the config gives one or ``mscale``s); and
``llama3`` (low frequencies divided by ``factor``, high ones kept, a smooth blend between). A GGUF
file stores llama3 scaling as a ``rope_freqs`` tensor of per-frequency divisors (llama.cpp's
converter writes ``1 / ((1 - smooth) / factor + smooth)``), which gives the same frequencies.

Anything else is a ``ValueError`` naming the field: another ``rope_type`` (longrope, su, ...),
partial rotary embeddings, per-layer RoPE, a key this module does not read (it could change the
math), a GGUF ``rope_*`` tensor other than ``rope_freqs``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np
import torch

from kvhive.config import ModelConfig, RopeScaling

# The config.json keys each kind reads, beyond rope_type/type, rope_theta and partial_rotary_factor.
_HF_KEYS = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "dynamic": frozenset({"factor", "original_max_position_embeddings"}),
    "yarn": frozenset({"factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
                       "beta_slow", "mscale", "mscale_all_dim", "truncate"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
}
_HF_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
_HF_COMMON = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})
# GGUF metadata keys under ``{arch}.rope.`` that this module reads (all others are refused).
_GGUF_KEYS = frozenset({"freq_base", "dimension_count", "scaling.type", "scaling.factor",
                        "scaling.original_context_length", "scaling.finetuned",
                        "scaling.yarn_beta_fast", "scaling.yarn_beta_slow"})
ROPE_FREQS_TENSOR = "rope_freqs.weight"


class RopeSpec(NamedTuple):
    """A checkpoint's RoPE as kvhive runs it: base, scaling, and how many positions it serves."""

    theta: float
    scaling: RopeScaling
    max_positions: int


def served_positions(scaling: RopeScaling, max_position_embeddings: int) -> int:
    """Positions kvhive serves: ``max_position_embeddings``, and for yarn at least
    ``original_max_position_embeddings * factor`` (as vLLM derives it).

    ``dynamic`` serves ``max_position_embeddings``: below it transformers' dynamic NTK uses the
    plain frequencies (its base grows only once a sequence passes that length, then every key is
    rotated anew each forward), so these positions are exactly transformers' and a KV cache of
    rotated keys stays valid. vLLM instead fixes the base for ``max_position_embeddings * factor``,
    which extends the context but differs from transformers at every length.
    """
    if scaling.kind == "yarn" and scaling.original_max_position_embeddings:
        return max(max_position_embeddings, int(scaling.original_max_position_embeddings * scaling.factor))
    return max_position_embeddings


def _refuse(where: str, what: str) -> ValueError:
    return ValueError(f"{where}: {what} is not supported")


def _hf_params(raw: Mapping[str, object], where: str) -> tuple[str, dict[str, object]]:
    """The config's RoPE dict and the field it came from (``rope_parameters`` or ``rope_scaling``)."""
    for name in ("rope_parameters", "rope_scaling"):
        params = raw.get(name)
        if params:
            if not isinstance(params, dict):
                raise ValueError(f"{where}: {name} must be an object, got {params!r}")
            if any(isinstance(v, dict) for v in params.values()):
                raise _refuse(where, f"{name} per layer type ({sorted(params)})")
            return name, dict(params)
    return "rope_scaling", {}


def rope_from_hf(raw: Mapping[str, object], head_dim: int, max_position_embeddings: int,
                 where: str = "config.json") -> RopeSpec:
    """The RoPE of a config.json (``rope_parameters`` or ``rope_scaling`` plus the top-level
    ``rope_theta``, ``partial_rotary_factor`` and ``original_max_position_embeddings``)."""
    name, params = _hf_params(raw, where)
    kind = str(params.get("rope_type", params.get("type", "default")))
    if kind not in _HF_KEYS:
        raise _refuse(where, f"{name}.rope_type {kind!r}")
    unknown = sorted(set(params) - _HF_KEYS[kind] - _HF_COMMON)
    if unknown:
        raise _refuse(where, f"{name}.{unknown[0]} (with rope_type {kind!r})")
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise _refuse(where, f"partial_rotary_factor {partial} (rotary embeddings on part of each head)")
    missing = [k for k in _HF_REQUIRED.get(kind, ()) if params.get(k) is None]
    if missing:
        raise ValueError(f"{where}: {name}.{missing[0]} is required for rope_type {kind!r}")
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    original = raw.get("original_max_position_embeddings", params.get("original_max_position_embeddings"))
    scaling = _hf_scaling(kind, params, int(original or max_position_embeddings))
    return RopeSpec(theta, scaling, served_positions(scaling, max_position_embeddings))


def _hf_scaling(kind: str, params: Mapping[str, object], original: int) -> RopeScaling:
    """RopeScaling of one config.json kind (keys already checked)."""
    def number(key: str, default: float) -> float:
        value = params.get(key)
        return default if value is None else float(value)

    factor = number("factor", 1.0)
    if kind in ("default", "linear", "dynamic"):
        return RopeScaling(kind=kind, factor=factor)
    if kind == "llama3":
        return RopeScaling(kind=kind, factor=factor, original_max_position_embeddings=original,
                           low_freq_factor=number("low_freq_factor", 1.0),
                           high_freq_factor=number("high_freq_factor", 4.0))
    return RopeScaling(kind="yarn", factor=factor, original_max_position_embeddings=original,
                       beta_fast=number("beta_fast", 0.0) or 32.0, beta_slow=number("beta_slow", 0.0) or 1.0,
                       truncate=bool(params.get("truncate", True)),
                       attention_factor=_yarn_attention_factor(factor, params))


def _yarn_attention_factor(factor: float, params: Mapping[str, object]) -> float:
    """YaRN's cos/sin scale: ``attention_factor``, else from ``mscale``/``mscale_all_dim``, else
    ``0.1 ln(factor) + 1`` (1 for factors up to 1)."""
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    m, m_all = params.get("mscale"), params.get("mscale_all_dim")
    if m and m_all:
        return float(mscale(factor, float(m)) / mscale(factor, float(m_all)))
    return mscale(factor)


def rope_from_gguf(field: Callable[[str], object], arch: str, head_dim: int, max_position_embeddings: int,
                   freq_factors: np.ndarray | None, where: str) -> RopeSpec:
    """The RoPE of a GGUF file: ``field(key)`` reads its metadata (None when absent),
    ``freq_factors`` is its ``rope_freqs`` tensor, if any."""
    prefix = f"{arch}.rope."
    dims = field(prefix + "dimension_count")
    if dims is not None and int(dims) != head_dim:
        raise _refuse(where, f"{prefix}dimension_count {dims} (rotary embeddings on part of each "
                             f"head of {head_dim})")
    theta = float(field(prefix + "freq_base") or 10000.0)
    kind = str(field(prefix + "scaling.type") or "none")
    factor = float(field(prefix + "scaling.factor") or 1.0)
    if kind == "none":
        scaling = RopeScaling()
    elif kind == "linear":
        scaling = RopeScaling(kind="linear", factor=factor)
    elif kind == "yarn":
        original = field(prefix + "scaling.original_context_length") or max_position_embeddings
        scaling = RopeScaling(kind="yarn", factor=factor, original_max_position_embeddings=int(original),
                              beta_fast=float(field(prefix + "scaling.yarn_beta_fast") or 32.0),
                              beta_slow=float(field(prefix + "scaling.yarn_beta_slow") or 1.0),
                              attention_factor=_yarn_attention_factor(factor, {}))
    else:
        raise _refuse(where, f"{prefix}scaling.type {kind!r}")
    if freq_factors is not None:
        if kind != "none":
            raise _refuse(where, f"a {ROPE_FREQS_TENSOR} tensor together with {prefix}scaling.type {kind!r}")
        if freq_factors.shape != (head_dim // 2,):
            raise ValueError(f"{where}: {ROPE_FREQS_TENSOR} has shape {list(freq_factors.shape)}, "
                             f"expected [{head_dim // 2}] (half of the head dimension)")
        scaling = RopeScaling(freq_factors=tuple(float(f) for f in freq_factors))
    return RopeSpec(theta, scaling, served_positions(scaling, max_position_embeddings))


def unread_gguf_rope_keys(keys: list[str], arch: str) -> list[str]:
    """The GGUF metadata keys under ``{arch}.rope.`` that ``rope_from_gguf`` does not read."""
    prefix = f"{arch}.rope."
    return [k for k in keys if k.startswith(prefix) and k[len(prefix):] not in _GGUF_KEYS]


def inverse_frequencies(scaling: RopeScaling, head_dim: int, theta: float) -> torch.Tensor:
    """The [head_dim / 2] float32 inverse frequencies of ``scaling`` (transformers' arithmetic)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    plain = 1.0 / (theta ** exponents)
    if scaling.freq_factors:
        return plain / torch.tensor(scaling.freq_factors, dtype=torch.float32)
    if scaling.kind == "linear":
        return plain / scaling.factor
    if scaling.kind == "llama3":
        return _llama3(plain, scaling)
    if scaling.kind == "yarn":
        return _yarn(theta ** exponents, scaling, head_dim, theta)
    return plain                          # default; dynamic below max_position_embeddings


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3's scaling: wavelengths past original/low_freq_factor slowed by ``factor``, those
    under original/high_freq_factor kept, a linear blend in 1/wavelength between."""
    original = s.original_max_position_embeddings or 8192
    wavelen = 2 * math.pi / inv_freq
    slow = torch.where(wavelen > original / s.low_freq_factor, inv_freq / s.factor, inv_freq)
    smooth = (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * slow / s.factor + smooth * slow
    medium = ~(wavelen < original / s.high_freq_factor) * ~(wavelen > original / s.low_freq_factor)
    return torch.where(medium, blended, slow)


def _yarn(pos_freqs: torch.Tensor, s: RopeScaling, head_dim: int, theta: float) -> torch.Tensor:
    """YaRN: per dimension, a ramp between the extrapolated (plain) and interpolated (/factor)
    frequency, from dimension ``low`` (beta_fast rotations) to ``high`` (beta_slow rotations)."""
    original = s.original_max_position_embeddings or 0

    def dimension_of(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_of(s.beta_fast), dimension_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp
    return (1.0 / (s.factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated


def rope_tables(config: ModelConfig, dtype: torch.dtype,
                device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed-sin tables [max_positions, head_dim] for rotate-half (HF-layout) RoPE.

    Computed in float32 exactly as transformers does (cos and sin times the attention factor),
    then cast to the model dtype. ``sin_signed = [-sin, +sin]`` so that
    ``rope(x) = x * cos + roll(x, head_dim / 2) * sin_signed``.
    """
    hd, scaling = config.head_dim, config.rope_scaling
    inv_freq = inverse_frequencies(scaling, hd, config.rope_theta)
    pos = torch.arange(config.max_position_embeddings, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if scaling.attention_factor != 1.0:
        cos, sin = cos * scaling.attention_factor, sin * scaling.attention_factor
    sign = torch.cat((-torch.ones(hd // 2), torch.ones(hd // 2)))
    return cos.to(dtype).to(device), (sin * sign).to(dtype).to(device)
