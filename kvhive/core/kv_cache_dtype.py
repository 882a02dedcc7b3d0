"""``--kv-cache-dtype``: which dtype the KV cache holds, resolved and checked once, torch-free.

``auto`` is the model's ``--dtype``; a float value must equal it (a float pool holds the model's
dtype); ``int8`` and ``fp8`` (``fp8_e4m3`` is its other name) are the packed 8-bit rows of
``kvhive.model.kv_quant``: ``head_dim`` one-byte codes and a two-byte bfloat16 scale per token and
KV head. The resolved name is the pool's, and it names the pool's rows in the store key space.
"""

from __future__ import annotations

OPTION = "--kv-cache-dtype"
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8", "fp8_e4m3")
QUANTIZED = ("int8", "fp8")
# Bytes of one value of a float pool, by dtype.
FLOAT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# An 8-bit row's scale (kv_quant.SCALE_BYTES).
SCALE_BYTES = 2


def check_kv_cache_dtype(kv_cache_dtype: str, dtype: str, on_cpu: bool, attention_backend: str = "auto") -> None:
    """ValueError naming --kv-cache-dtype for a value kvhive does not know or cannot run with the
    model's ``dtype`` (``auto``: not resolved yet, checked again once it is) on this device, or with
    ``--attention-backend triton`` (the Triton kernels read float pools only)."""
    kv = kv_cache_dtype
    if kv not in KV_CACHE_DTYPES:
        raise ValueError(f"{OPTION} must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv!r}")
    if kv == "float16" and on_cpu:
        raise ValueError(f"{OPTION} float16 needs a GPU (as --dtype float16 does); on CPU use bfloat16, int8 or fp8")
    if kv in FLOAT_BYTES and dtype != "auto" and kv != dtype:
        raise ValueError(f"{OPTION} {kv} with --dtype {dtype}: a float KV cache holds the model's dtype; "
                         f"use auto (the model's), int8 or fp8")
    if kv in (*QUANTIZED, "fp8_e4m3") and attention_backend == "triton":
        raise ValueError(f"--attention-backend triton reads float KV pools only, not {OPTION} {kv}; "
                         f"use --attention-backend auto or torch (torch on the dequantised K/V)")


def canonical_kv_dtype(name: str) -> str:
    """The one name of a --kv-cache-dtype value (``fp8_e4m3`` is ``fp8``)."""
    return "fp8" if name == "fp8_e4m3" else name


def resolve_kv_dtype(kv_cache_dtype: str, dtype: str) -> str:
    """The pool's KV dtype: float32, bfloat16, float16 (``auto``: the model's ``dtype``), int8 or fp8."""
    return dtype if kv_cache_dtype == "auto" else canonical_kv_dtype(kv_cache_dtype)


def is_quantized(kv_dtype: str) -> bool:
    """True for a resolved KV dtype whose rows are packed 8-bit codes with a scale."""
    return kv_dtype in QUANTIZED


def kv_row_bytes(head_dim: int, kv_dtype: str) -> int:
    """Bytes of one (token, KV head) row of K or V in a pool of resolved ``kv_dtype``."""
    if is_quantized(kv_dtype):
        return head_dim + SCALE_BYTES
    return head_dim * FLOAT_BYTES[kv_dtype]
