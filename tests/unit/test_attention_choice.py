"""A bf16 runner measures whether torch's prefill attention beats the C++ kernel on this CPU (where
asked to), and takes the faster; either path gives the same logits within bf16 rounding."""

from __future__ import annotations

import pytest
import torch
from support.runners import prompt, seq
from support.tiny import tiny_model

from kvhive.engine.runner import ModelRunner
from kvhive.engine.step import StepPlan
from kvhive.model import attention
from kvhive.model.prefill_kernel import CpuPrefillKernel

_PREFILL = CpuPrefillKernel.load()
needs_bf16_kernel = pytest.mark.skipif(_PREFILL is None or torch.bfloat16 not in _PREFILL.dtypes,
                                       reason="no bf16 prefill kernel on this CPU")


@needs_bf16_kernel
def test_the_measurement_runs_both_paths() -> None:
    kernel = CpuPrefillKernel.load()
    assert attention.torch_prefill_is_faster(kernel, torch.bfloat16, 9, 3, 64) in (True, False)
    assert attention.torch_prefill_is_faster(kernel, torch.bfloat16, 9, 3, 64, margin=0.0) is False
    assert kernel.bf16_path != "auto"        # the kernel's own bf16 path was settled on its first call


@needs_bf16_kernel
@pytest.mark.parametrize("torch_faster", [True, False])
def test_the_runner_takes_the_faster_path(monkeypatch, torch_faster: bool) -> None:
    model = tiny_model(dtype="bfloat16")
    monkeypatch.setattr("kvhive.engine.attention_kernels.torch_prefill_is_faster", lambda *a, **k: torch_faster)
    measured = ModelRunner(model, model.config, num_blocks=64, block_size=16, dtype="bfloat16",
                           measure_attention=True)
    assert (measured.prefill_kernel is None) == torch_faster
    assert measured.decode_kernel is not None                          # decode keeps its kernel
    kept = ModelRunner(model, model.config, num_blocks=64, block_size=16, dtype="bfloat16")
    assert kept.prefill_kernel is not None                             # not asked to measure
    # A fresh prompt, then 20 more tokens on its cached 37: the logits of every computed row.
    first, more = prompt(37, 1), prompt(20, 2)
    logits = []
    for runner in (measured, kept):
        rows = []
        for plan in (StepPlan([seq("a", first, 0, [3, 7, 5, 9])]), StepPlan([seq("a", more, 37, [3, 7, 5, 9])])):
            inputs = runner.prepare_inputs(plan, all_rows=True)
            with torch.inference_mode():
                hidden = runner.model(inputs.input_ids, inputs.positions, inputs.attn, runner.kv_cache)
                rows.append(runner.model.compute_logits(hidden))
        logits.append(torch.cat(rows))
    assert logits[0].shape == (57, model.config.vocab_size)
    torch.testing.assert_close(logits[0], logits[1], atol=0.15, rtol=0.05)
