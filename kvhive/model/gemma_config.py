"""Gemma 2 / Gemma 3 config.json keys: which layers attend to a window, the caps, the two RoPE bases.

``layer_types`` lists ``sliding_attention`` or ``full_attention`` per layer; configs without it
follow ``sliding_window_pattern`` (Gemma 2: every other layer starting with the first; Gemma 3:
five window layers, then a global one). Gemma 3's RoPE comes as ``rope_parameters`` per layer
type (``full_attention`` may be scaled; ``sliding_attention`` must be the default RoPE) or, in
older files, as ``rope_theta`` / ``rope_scaling`` for the global layers and
``rope_local_base_freq`` for the window layers. Anything else is a refusal naming the key.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from kvhive.config import GemmaSpec

LAYER_TYPES = {"sliding_attention": True, "full_attention": False}


def _number(merged: Mapping[str, object], key: str, where: str) -> float | None:
    """A positive number config key, or None when it is null (ValueError naming it otherwise)."""
    value = merged.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{where}: {key} must be a positive number or null, got {value!r}")
    return float(value)


def window_layers(merged: Mapping[str, object], num_layers: int, where: str) -> tuple[bool, ...]:
    """Per layer: True where it attends to the sliding window (``layer_types`` or the pattern)."""
    types = merged.get("layer_types")
    if types is None:
        pattern = merged.get("sliding_window_pattern")
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
            raise ValueError(f"{where}: sliding_window_pattern must be a positive integer, got {pattern!r}")
        return tuple(bool((i + 1) % pattern) for i in range(num_layers))
    if not isinstance(types, list) or len(types) != num_layers:
        raise ValueError(f"{where}: layer_types must list one type per layer ({num_layers}), got {types!r}")
    for i, kind in enumerate(types):
        if kind not in LAYER_TYPES:
            raise ValueError(f"{where}: layer_types[{i}] {kind!r} is not supported "
                             f"(supported: {', '.join(LAYER_TYPES)})")
    return tuple(LAYER_TYPES[kind] for kind in types)


def gemma_rope_raw(raw: Mapping[str, object], defaults: Mapping[str, object],
                   where: str) -> tuple[dict[str, object], float | None]:
    """The config.json view whose RoPE the global layers use, and the window layers' RoPE base
    (None: the same RoPE as the global layers, Gemma 2)."""
    base = {"rope_theta": defaults.get("rope_theta", 10000.0), **raw}
    params = raw.get("rope_parameters")
    if isinstance(params, Mapping) and ("full_attention" in params or "sliding_attention" in params):
        local = params.get("sliding_attention") or {}
        if not isinstance(local, Mapping) or local.get("rope_type", "default") != "default":
            kind = local.get("rope_type") if isinstance(local, Mapping) else local
            raise ValueError(f"{where}: rope_parameters.sliding_attention.rope_type {kind!r} is not supported "
                             "(window layers run the default RoPE)")
        theta = _number(local, "rope_theta", where) or float(str(defaults.get("rope_local_base_freq", 10000.0)))
        return {**base, "rope_parameters": params.get("full_attention") or {"rope_type": "default"}}, theta
    if "rope_local_base_freq" not in defaults:
        return base, None
    theta = _number(raw, "rope_local_base_freq", where) or float(str(defaults["rope_local_base_freq"]))
    return base, theta


def gemma_spec(merged: Mapping[str, object], num_layers: int, local_theta: float | None, where: str) -> GemmaSpec:
    """The Gemma part of the model config from config.json keys (family defaults merged in)."""
    windows = window_layers(merged, num_layers, where)
    window = merged.get("sliding_window")
    if any(windows) and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise ValueError(f"{where}: sliding_window must be a positive integer, got {window!r}")
    scalar = _number(merged, "query_pre_attn_scalar", where)
    if scalar is None:
        raise ValueError(f"{where}: query_pre_attn_scalar is missing")
    return GemmaSpec(query_pre_attn_scalar=scalar, window_layers=windows,
                     sliding_window=int(window) if any(windows) else None,   # type: ignore[arg-type]
                     attn_logit_softcapping=_number(merged, "attn_logit_softcapping", where),
                     final_logit_softcapping=_number(merged, "final_logit_softcapping", where),
                     local_rope_theta=local_theta)


# llama.cpp's fixed values for GGUF Gemma files: window layers per pattern, the window layers'
# RoPE base (Gemma 3), and the layer count whose score scale is hidden / heads (the 27B models).
GGUF_PATTERN = {"gemma2": 2, "gemma3": 6}
GGUF_LOCAL_THETA = {"gemma3": 10000.0}
GGUF_WIDE_SCALE_LAYERS = {"gemma2": 46, "gemma3": 62}
GGUF_DEFAULTS = {"gemma2": {"sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
                 "gemma3": {}}


def gguf_gemma_spec(field: Callable[[str], object], arch: str, num_layers: int, hidden: int, heads: int,
                    head_dim: int, where: str) -> GemmaSpec:
    """The Gemma part of the model config from GGUF metadata, as llama.cpp reads it."""
    defaults = GGUF_DEFAULTS[arch]
    pattern = field(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ValueError(f"{where}: GGUF metadata {arch}.attention.sliding_window_pattern lists "
                             f"{len(pattern)} layers, {arch}.block_count is {num_layers}")
        windows = tuple(bool(w) for w in pattern)
    else:
        period = int(pattern) if pattern is not None else GGUF_PATTERN[arch]    # type: ignore[call-overload]
        windows = tuple(period > 0 and i % period < period - 1 for i in range(num_layers))
    window = field(f"{arch}.attention.sliding_window") or defaults.get("sliding_window")
    if any(windows) and window is None:
        raise ValueError(f"{where}: GGUF metadata {arch}.attention.sliding_window is missing")
    scalar = hidden / heads if num_layers == GGUF_WIDE_SCALE_LAYERS[arch] else head_dim

    def cap(key: str) -> float | None:
        value = field(f"{arch}.{key}")
        value = defaults.get(key) if value is None else value
        return None if value is None or not float(str(value)) else float(str(value))

    return GemmaSpec(query_pre_attn_scalar=float(scalar), window_layers=windows,
                     sliding_window=int(str(window)) if any(windows) else None,
                     attn_logit_softcapping=cap("attn_logit_softcapping") if arch == "gemma2" else None,
                     final_logit_softcapping=cap("final_logit_softcapping") if arch == "gemma2" else None,
                     local_rope_theta=GGUF_LOCAL_THETA.get(arch))
