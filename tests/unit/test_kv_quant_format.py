"""The packed 8-bit KV row format (kvhive.model.kv_quant): layout, exact dequantisation, bounds."""

from __future__ import annotations

import pytest
import torch

from kvhive.model.kv_quant import (
    SCALE_BYTES,
    canonical_kv_dtype,
    dequantize_rows,
    head_dim_of,
    is_quantized_pool,
    pool_kv_dtype,
    quantize_rows,
    row_elements,
)


@pytest.mark.parametrize("kv_dtype,bound", [("int8", 0.5 / 127), ("fp8", 1 / 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_error_within_the_code_step(kv_dtype: str, bound: float, dtype: torch.dtype) -> None:
    x = (torch.randn(7, 3, 64, generator=torch.Generator().manual_seed(1)) * 5).to(dtype)
    packed = quantize_rows(x, kv_dtype)
    assert packed.shape == (7, 3, 64 + SCALE_BYTES) and is_quantized_pool(packed)
    assert pool_kv_dtype(packed) == kv_dtype and head_dim_of(packed) == 64
    y = dequantize_rows(packed)
    amax = x.float().abs().amax(-1, keepdim=True)
    # The scale is rounded to bfloat16 (up to 2^-8 relative), then codes are rounded to their step.
    assert ((y - x.float()).abs() <= amax * bound * 1.01 + 1e-30).all()
    assert dequantize_rows(packed, dtype).dtype == dtype


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_zero_rows_and_extremes(kv_dtype: str) -> None:
    x = torch.zeros(2, 16)
    x[1, 3], x[1, 5] = 1e30, -1e-30
    y = dequantize_rows(quantize_rows(x, kv_dtype))
    assert torch.equal(y[0], torch.zeros(16))
    assert torch.isfinite(y).all() and y[1, 3] == pytest.approx(1e30, rel=1 / 64)


def test_the_scale_is_the_rows_last_two_bytes_as_bfloat16() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5, 127.0]])
    raw = quantize_rows(x, "int8").view(torch.uint8)
    assert raw[0, 4:].contiguous().view(torch.bfloat16).item() == 1.0
    assert raw[0, :4].view(torch.int8).tolist() == [1, -2, 0, 127]      # 0.5 rounds to even


def test_fp8_codes_convert_through_float16_for_every_byte() -> None:
    """The kernels' conversion: byte b as float16 bits ((b & 0x7f) << 7 | (b & 0x80) << 8), times 256."""
    b = torch.arange(256, dtype=torch.int32)
    via_half = (((b & 0x7F) << 7) | ((b & 0x80) << 8)).to(torch.int16).view(torch.float16).float() * 256
    exact = b.to(torch.uint8).view(torch.float8_e4m3fn).float()
    finite = ~exact.isnan()
    assert finite.sum() == 254 and torch.equal(via_half[finite], exact[finite])


def test_names() -> None:
    assert canonical_kv_dtype("fp8_e4m3") == "fp8"
    assert row_elements(64, "int8") == 66 and row_elements(64, "bfloat16") == 64
    assert head_dim_of(torch.zeros(1, 1, 2, 4, 2, 64)) == 64
