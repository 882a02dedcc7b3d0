"""What attention reads from and writes to a KV pool of either kind: float values, or 8-bit rows.

A float pool holds K/V values as they are. A quantized pool (``kvhive.model.kv_quant``: int8 or
fp8 codes with a bfloat16 scale per token and KV head) holds packed rows: ``store_rows`` packs a
step's new K/V for it, and every torch path turns what it gathers back into values with
``gathered_values``. Attention over a quantized pool always reads the quantized values, a first
chunk's own new K/V included (``stored_values``): a token's attention is then the same whether its
context was computed in this step, hit in the prefix cache or restored from a tier.
"""

from __future__ import annotations

import torch

from kvhive.model.kv_quant import dequantize_rows, pool_kv_dtype, quantize_rows


def store_rows(kv_new: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    """``kv_new`` ([..., head_dim]) as the pool's rows: itself for a float pool, packed for an 8-bit one."""
    kv_dtype = pool_kv_dtype(kv_cache)
    return kv_new if kv_dtype is None else quantize_rows(kv_new, kv_dtype)


def gathered_values(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values ([..., head_dim] of ``dtype``) of rows gathered from a pool: float rows as they are,
    packed 8-bit rows dequantised."""
    return rows if pool_kv_dtype(rows) is None else dequantize_rows(rows, dtype)


def stored_values(kv_new: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    """The values attention reads for ``kv_new`` once it is in the pool: ``kv_new`` for a float
    pool; for an 8-bit one, its rows quantized and dequantised (what a later step reads back)."""
    kv_dtype = pool_kv_dtype(kv_cache)
    if kv_dtype is None:
        return kv_new
    return dequantize_rows(quantize_rows(kv_new, kv_dtype), kv_new.dtype)
