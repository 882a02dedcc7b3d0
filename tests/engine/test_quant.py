"""Matmul from GGUF blocks (kvhive.model.quant): exact weights, both kernel builds, the model wiring."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from kvhive.core.model_files import default_model_path
from kvhive.engine.runner import ModelRunner
from kvhive.engine.step import ScheduledSeq, StepPlan
from kvhive.model import cpu
from kvhive.model.llama import QUANT_MAX_ROWS
from kvhive.model.loader import load_model
from kvhive.model.quant import QuantMatmul, QuantWeight
from kvhive.request import SamplingParams


@pytest.fixture(scope="module")
def gguf_tensors():
    reader = GGUFReader(str(default_model_path()))
    return {t.name: t for t in reader.tensors}


@pytest.fixture(scope="module", params=[lvl for lvl in cpu.LEVELS if cpu.detect().supports(lvl)])
def kernel(request) -> QuantMatmul:
    kern = QuantMatmul.load(request.param)
    if kern is None:
        pytest.skip("no C++ compiler")
    return kern


def _weight(tensor) -> tuple[QuantWeight, torch.Tensor]:
    out_features, in_features = int(tensor.shape[1]), int(tensor.shape[0])
    w = QuantWeight.from_gguf(tensor.tensor_type.name, tensor.data, out_features, in_features)
    ref = dequantize(tensor.data, tensor.tensor_type).reshape(out_features, in_features)
    return w, torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32))


@pytest.mark.parametrize("name", ["blk.0.ffn_up.weight", "blk.7.attn_k.weight", "token_embd.weight"])
def test_blocks_rebuild_exactly_what_gguf_dequantises(gguf_tensors, name) -> None:
    w, ref = _weight(gguf_tensors[name])
    assert w.kind == gguf_tensors[name].tensor_type.name
    assert torch.equal(w.dequantize(), ref)


@pytest.mark.parametrize("name", ["blk.3.ffn_down.weight", "blk.3.attn_q.weight", "token_embd.weight"])
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 12, 13, 16, 25])
def test_kernel_equals_float64_matmul(kernel, gguf_tensors, name, rows) -> None:
    w, ref = _weight(gguf_tensors[name])
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 2 * w.shape[1], generator=gen)[:, ::2].contiguous()
    residual = torch.randn(rows, w.shape[0], generator=gen)
    expected = x.double() @ ref.double().T
    scale = expected.abs().max()
    assert (kernel(x, w).double() - expected).abs().max() / scale < 1e-6
    assert (kernel(x, w, residual).double() - (expected + residual.double())).abs().max() / scale < 1e-6


@pytest.mark.parametrize("name", ["blk.5.ffn_gate.weight", "token_embd.weight"])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 11, 12, 16])
def test_kernel_rebuilds_each_weight_exactly(kernel, gguf_tensors, name, rows) -> None:
    """One-hot rows pick single columns: each sum is one weight times 1 plus zeros, so it equals
    gguf's dequantised weight bit for bit."""
    w, ref = _weight(gguf_tensors[name])
    cols = torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(rows))[:rows]
    x = torch.zeros(rows, w.shape[1])
    x[torch.arange(rows), cols] = 1.0
    assert torch.equal(kernel(x, w), ref[:, cols].T)


@pytest.mark.parametrize("name", ["blk.3.attn_q.weight", "blk.3.ffn_down.weight"])
def test_a_rows_sums_do_not_depend_on_the_rows_beside_it(kernel, gguf_tensors, name) -> None:
    """From 5 rows on, a row's sums are the same bits whatever the step's row count: a decode step
    with draft tokens (9 rows for 8 requests) or more requests computes each request's row as the
    plain step does, so the tiling never parts speculated from plain greedy tokens."""
    w, _ = _weight(gguf_tensors[name])
    x = torch.randn(25, w.shape[1], generator=torch.Generator().manual_seed(5))
    residual = torch.randn(25, w.shape[0], generator=torch.Generator().manual_seed(6))
    every = kernel(x, w, residual)
    for rows in range(5, 25):
        assert torch.equal(kernel(x[:rows], w, residual[:rows]), every[:rows]), rows


def test_kernel_reads_strided_rows_and_bfloat16(kernel, gguf_tensors) -> None:
    w, ref = _weight(gguf_tensors["blk.1.ffn_gate.weight"])
    wide = torch.randn(5, w.shape[1] + 64)
    x = wide[:, 32:32 + w.shape[1]]                      # row stride != in_features
    expected = x.double() @ ref.double().T
    assert (kernel(x, w).double() - expected).abs().max() / expected.abs().max() < 1e-6
    y = kernel(x.bfloat16(), w)
    assert y.dtype == torch.bfloat16
    assert (y.double() - expected).abs().max() / expected.abs().max() < 2e-2


@pytest.mark.parametrize("rows", [1, 3, 8, 12])
def test_bfloat16_in_and_out_equal_the_float32_path_rounded_once(kernel, gguf_tensors, rows) -> None:
    """bf16 x and residual are read by the kernel: the same sums as float32 copies, one rounding."""
    w, _ = _weight(gguf_tensors["blk.4.attn_output.weight"])
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, w.shape[1], generator=gen).bfloat16()
    residual = torch.randn(rows, w.shape[0], generator=gen).bfloat16()
    for res in (None, residual, residual.float()):
        y = kernel(x, w, res)
        assert y.dtype == torch.bfloat16
        assert torch.equal(y, kernel(x.float(), w, None if res is None else res.float()).bfloat16())
    assert kernel(x[:0], w).shape == (0, w.shape[0])


def test_fused_and_reordered_weights_keep_their_rows(gguf_tensors) -> None:
    a, ra = _weight(gguf_tensors["blk.2.ffn_gate.weight"])
    b, rb = _weight(gguf_tensors["blk.2.ffn_up.weight"])
    fused = QuantWeight.concat([a, b])
    assert torch.equal(fused.dequantize(), torch.cat([ra, rb]))
    order = np.random.default_rng(0).permutation(a.shape[0])
    assert torch.equal(a.take_rows(order).dequantize(), ra[torch.from_numpy(order)])
    q8, _ = _weight(gguf_tensors["token_embd.weight"])
    with pytest.raises(ValueError, match="different quantisations"):
        QuantWeight.concat([a, q8])


def test_bad_shapes_are_refused(kernel, gguf_tensors) -> None:
    w, _ = _weight(gguf_tensors["blk.0.ffn_up.weight"])
    with pytest.raises(ValueError, match="rows"):
        kernel(torch.randn(2, w.shape[1] + 1), w)
    with pytest.raises(ValueError, match="unsupported quantisation"):
        QuantWeight.from_gguf("Q5_K", np.zeros(64, np.uint8), 1, 32)


def test_decode_through_blocks_gives_the_dense_tokens() -> None:
    """Few-row steps (decode) through the GGUF blocks; the same greedy tokens as the dense copy."""
    if QuantMatmul.load() is None:
        pytest.skip("no C++ compiler")
    loaded = load_model(default_model_path(), quantized_matmul=True)
    kernel = loaded.model.qmatmul
    assert kernel is not None
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3717, 411, 1789, 28, 2, 198, 1]
    outputs = []
    for qmatmul in (kernel, None):               # the blocks, then the same model's dense weights
        loaded.model.qmatmul = qmatmul
        runner = ModelRunner(loaded.model, loaded.config, num_blocks=8, block_size=16)
        tokens, computed = list(prompt), 0
        for _ in range(24):                      # prefill (dense in both), then 23 decode steps
            seq = ScheduledSeq("r", tokens[computed:], computed, list(range(8)), True,
                               SamplingParams(temperature=0))
            result = runner.execute(StepPlan([seq]))
            computed = len(tokens)
            tokens.append(result.sampled["r"])
        outputs.append(tokens[len(prompt):])
    assert outputs[0] == outputs[1]
    assert min(QUANT_MAX_ROWS.values()) >= 8     # a batch of 8 decodes stays on the blocks
