"""The fused C++ RMSNorm, SiLU-and-multiply and RoPE equal the torch composites they replace, at
every ISA level this CPU runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.tiny import tiny_config

from kvhive.model import cpu
from kvhive.model.fused import FusedOps
from kvhive.model.llama import TorchOps, rope_tables

ROWS = pytest.mark.parametrize("rows", [1, 3, 17, 200])
F32_TOL = dict(atol=2e-5, rtol=1e-5)


@pytest.fixture(scope="module", params=[lvl for lvl in cpu.LEVELS if cpu.detect().supports(lvl)])
def fused(request) -> FusedOps:
    ops = FusedOps.load(request.param)
    if ops is None:
        pytest.skip("no C++ compiler")
    assert ops.isa == request.param
    return ops


def hf_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: statistics in float32, the normalised x rounded, then scaled."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def ulps_bf16(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in bfloat16 steps between two bf16 tensors of the same sign pattern."""
    ia, ib = (t.view(torch.int16).to(torch.int32) for t in (a, b))
    return int((ia - ib).abs().max()) if a.numel() else 0


@ROWS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(fused: FusedOps, rows: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows)
    x = (3 * torch.randn(rows, 80, generator=g)).to(dtype)[:, :64]          # strided rows
    w = (1 + 0.1 * torch.randn(64, generator=g)).to(dtype)
    got, want = fused.rms_norm(x, w, 1e-5), hf_rms_norm(x, w, 1e-5)
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, **F32_TOL)
    else:
        assert torch.equal(got, want)


@ROWS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(fused: FusedOps, rows: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows)
    gate_up = (4 * torch.randn(rows, 2 * 75, generator=g)).to(dtype)     # 75: a tail past 8- and 16-wide vectors
    got = fused.silu_mul(gate_up)
    want = F.silu(gate_up[:, :75]) * gate_up[:, 75:]
    assert torch.equal(TorchOps.silu_mul(gate_up), want)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, **F32_TOL)
    else:
        # exp may round silu the other way at a bf16 boundary: 1 step of silu, up to 2 of the product
        assert ulps_bf16(got, want) <= 2


@ROWS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place(fused: FusedOps, rows: int, dtype: torch.dtype) -> None:
    cfg = tiny_config(head_dim=32, max_position_embeddings=512, rope_theta=10000.0)
    cos, sin = rope_tables(cfg, dtype, "cpu")
    g = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, 7, 32, generator=g).to(dtype)
    positions = torch.randint(0, 512, (rows,), generator=g)
    got, want, torch_ops = qkv.clone(), qkv.clone(), qkv.clone()
    fused.rope(got[:, :5], fused.prepare_rope(positions, cos, sin))
    qk = want[:, :5]
    torch.addcmul(qk * cos[positions].unsqueeze(1), torch.roll(qk, 16, -1), sin[positions].unsqueeze(1), out=qk)
    TorchOps.rope(torch_ops[:, :5], TorchOps.prepare_rope(positions, cos, sin))
    assert torch.equal(torch_ops, want)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, **F32_TOL)
    else:
        assert torch.equal(got, want)
    assert torch.equal(got[:, 5:], qkv[:, 5:])          # the V heads are untouched


def test_bad_shapes_are_refused(fused: FusedOps) -> None:
    cfg = tiny_config(head_dim=32, max_position_embeddings=64)
    cos, sin = rope_tables(cfg, torch.float32, "cpu")
    with pytest.raises(IndexError, match="past the model's 64 rotary positions"):
        fused.prepare_rope(torch.tensor([3, 64]), cos, sin)
    with pytest.raises(ValueError, match="int64"):
        fused.rope_(torch.zeros(2, 3, 32), torch.zeros(2, dtype=torch.int32), cos, sin)
    with pytest.raises(ValueError, match="even width"):
        fused.silu_mul(torch.zeros(2, 7))
    with pytest.raises(ValueError, match="weight"):
        fused.rms_norm(torch.zeros(2, 8), torch.zeros(8, dtype=torch.bfloat16), 1e-5)

