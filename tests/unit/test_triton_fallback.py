"""Where the Triton kernels cannot run: ``--attention-backend triton`` refuses to start (a ValueError
naming the flag, which ``kvhive serve`` turns into exit 2), ``auto`` takes the gather path with a log
line. No kernel is launched here, so no interpreter is needed."""

from __future__ import annotations

import importlib
import logging

import pytest
import torch
from support.tiny import tiny_config, tiny_model
from support.triton_interpret import needs_triton

from kvhive.engine import attention_kernels
from kvhive.engine.attention_kernels import AttentionKernels, choose_attention_kernels
from kvhive.engine.runner import ModelRunner

CUDA = torch.device("cuda")


def choose(device: torch.device, backend: str) -> AttentionKernels:
    return choose_attention_kernels(tiny_config(), torch.float32, device, True, None, False, backend=backend)


def test_triton_on_cpu_without_the_interpreter_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="--attention-backend triton: .*TRITON_INTERPRET=1"):
        choose(torch.device("cpu"), "triton")
    model = tiny_model()
    with pytest.raises(ValueError, match="--attention-backend triton"):
        ModelRunner(model, model.config, num_blocks=16, block_size=4, attention_backend="triton")
    assert choose(torch.device("cpu"), "torch") == AttentionKernels(None, None)


@pytest.fixture
def no_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """Importing the Triton kernel modules fails as it does where triton is not installed."""
    real = importlib.import_module

    def import_module(name: str, *args: object):
        if name.startswith("kvhive.model.triton_"):
            raise ModuleNotFoundError("No module named 'triton'")
        return real(name, *args)

    monkeypatch.setattr(attention_kernels.importlib, "import_module", import_module)


def test_auto_on_cuda_without_triton_gathers_with_a_log_line(no_triton, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvhive.engine.attention_kernels"):
        assert choose(CUDA, "auto") == AttentionKernels(None, None)
    assert "TritonDecodeKernel is unavailable (No module named 'triton')" in caplog.text
    assert "gathers K/V for torch instead" in caplog.text
    with pytest.raises(ValueError, match="--attention-backend triton: TritonDecodeKernel is unavailable"):
        choose(CUDA, "triton")


@needs_triton
def test_a_kernel_that_cannot_launch_is_not_taken(monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    # No launch happens here (the check fails first), so the module may be imported without the interpreter.
    module = importlib.import_module("kvhive.model.triton_decode")

    def fails(self, device: torch.device) -> bool:
        raise RuntimeError("no kernel image for this device")

    monkeypatch.setattr(module.TritonDecodeKernel, "self_check", fails)
    with caplog.at_level(logging.WARNING):
        assert module.TritonDecodeKernel.load(CUDA) is None
        assert choose(CUDA, "auto").decode is None
    assert "Triton decode kernel cannot run on cuda: RuntimeError: no kernel image" in caplog.text
    assert "TritonDecodeKernel cannot compile on cuda" in caplog.text
    monkeypatch.setattr(module.TritonDecodeKernel, "self_check", lambda self, device: False)
    assert module.TritonDecodeKernel.load(CUDA) is None
