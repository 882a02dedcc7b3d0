"""8-bit KV: the packed row format of a quantized KV pool, and its torch reference.

A quantized pool keeps the one-pool layout (``kv_cache[num_blocks, num_layers, 2, block_size,
kv_heads, row]``) with one row per (token, KV head) of ``head_dim + 2`` bytes::

    bytes 0 .. head_dim - 1     the head's K (or V) values as 8-bit codes
    bytes head_dim, head_dim+1  the row's scale, a bfloat16 (little-endian)

    value[i] = decode(code[i]) * scale

Two codes (``--kv-cache-dtype``):

- ``int8``: a signed integer in [-127, 127]; scale = bf16(amax / 127).
- ``fp8`` (``fp8_e4m3``): an OCP float8 E4M3 ("fn": no infinities, max 448); scale = bf16(amax / 448).

``amax`` is the row's largest |value| in float32; the scale is rounded to bfloat16 first and the
codes are computed with that rounded scale (clamped to the code's range), so a kernel dequantising
``decode(code) * scale`` in float32 gets exactly the values this module gets: both factors are short
(int8: 7 bits, E4M3: 4 significant bits; bf16: 8), so their float32 product is exact. A row of zeros
has scale 0 and codes 0.

The pool tensor's dtype says which format it holds: ``torch.int8`` for int8, ``torch.float8_e4m3fn``
for fp8 (the scale's two bytes are stored as two elements of that dtype and read through a byte
view). So a block is still one contiguous slice, and every tier, transfer and store object moves a
quantized block as the bytes it is, with the format named in its store key's dtype.

The scale per token and head (not per tensor) needs no calibration and follows each row's range;
it costs 2 bytes per ``head_dim`` (3% at 64). In a kernel, E4M3's byte becomes a float through
float16: ``((b & 0x7f) << 7) | ((b & 0x80) << 8)`` read as float16 is the value times 2^-8 for every
finite code, normal or subnormal, so a kernel converts with F16C and folds 256 into the scale.
"""

from __future__ import annotations

import torch

from kvhive.core.kv_cache_dtype import QUANTIZED as QUANTIZED_KV_DTYPES
from kvhive.core.kv_cache_dtype import SCALE_BYTES, canonical_kv_dtype

_CODE_MAX = {"int8": 127.0, "fp8": 448.0}
_POOL_DTYPE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def is_quantized_pool(kv_cache: torch.Tensor) -> bool:
    """Whether a pool tensor holds packed 8-bit rows (its dtype says so)."""
    return kv_cache.dtype in (torch.int8, torch.float8_e4m3fn)


def pool_kv_dtype(kv_cache: torch.Tensor) -> str | None:
    """``"int8"`` or ``"fp8"`` for a quantized pool, None for a float one."""
    if kv_cache.dtype == torch.int8:
        return "int8"
    if kv_cache.dtype == torch.float8_e4m3fn:
        return "fp8"
    return None


def pool_dtype(kv_dtype: str) -> torch.dtype:
    """The torch dtype of a quantized pool's tensor."""
    return _POOL_DTYPE[canonical_kv_dtype(kv_dtype)]


def row_elements(head_dim: int, kv_dtype: str) -> int:
    """Elements of the pool's last axis: head_dim, plus the scale's 2 bytes when quantized."""
    return head_dim + SCALE_BYTES if canonical_kv_dtype(kv_dtype) in QUANTIZED_KV_DTYPES else head_dim


def head_dim_of(kv_cache: torch.Tensor) -> int:
    """The model's head_dim for a pool tensor of either kind."""
    return kv_cache.shape[-1] - (SCALE_BYTES if is_quantized_pool(kv_cache) else 0)


def quantize_rows(x: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """Packed rows ([..., head_dim + 2] of the pool's dtype) for values x ([..., head_dim], any float dtype)."""
    kv_dtype = canonical_kv_dtype(kv_dtype)
    code_max = _CODE_MAX[kv_dtype]
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / code_max).to(torch.bfloat16)
    scale_f = scale.float()
    safe = torch.where(scale_f > 0, scale_f, torch.ones_like(scale_f))
    scaled = (xf / safe).clamp_(-code_max, code_max)
    packed = torch.empty((*x.shape[:-1], x.shape[-1] + SCALE_BYTES), dtype=torch.uint8, device=x.device)
    if kv_dtype == "int8":
        codes = scaled.round_().to(torch.int8)
    else:
        codes = scaled.to(torch.float8_e4m3fn)
    packed[..., :x.shape[-1]] = codes.view(torch.uint8)
    packed[..., x.shape[-1]:] = scale.view(torch.uint8).view(*x.shape[:-1], SCALE_BYTES)
    return packed.view(_POOL_DTYPE[kv_dtype])


def dequantize_rows(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values ([..., head_dim] of ``dtype``) of packed rows ([..., head_dim + 2], int8 or float8_e4m3fn)."""
    head_dim = packed.shape[-1] - SCALE_BYTES
    raw = packed.view(torch.uint8)
    scale = raw[..., head_dim:].contiguous().view(torch.bfloat16).float()       # [..., 1]
    codes = raw[..., :head_dim].view(packed.dtype).float()
    return (codes * scale).to(dtype)
