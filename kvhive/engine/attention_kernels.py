"""Which attention implementation a runner uses: kvhive's C++ CPU kernels, Triton paged kernels, or torch.

On CPU with a float32 or bfloat16 pool, decode and prefill attention read the paged pool straight
through C++ kernels built for the CPU's ISA level (``kvhive.model.cpu``). On CUDA they read it
through Triton kernels (``kvhive.model.triton_decode``, ``kvhive.model.triton_prefill``) that walk
each sequence's block table in place. Elsewhere (no compiler, no Triton, a shape a kernel does not
support, ``--attention-backend torch`` or ``native_attention`` off) torch runs it on gathered K/V,
and the runner logs which path each attention takes. A bfloat16 pool on CPU may measure, on a
synthetic layer, whether torch's prefill beats the kernel's.

``--attention-backend``: ``auto`` (the above), ``triton`` (the Triton kernels or a ValueError, which
``kvhive serve`` turns into exit 2; on CPU they run only under ``TRITON_INTERPRET=1``, which the
tests use to check them against torch without a GPU), ``torch`` (gathered K/V everywhere).
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from kvhive.config import ModelConfig
from kvhive.model.attention import torch_prefill_is_faster
from kvhive.model.decode_kernel import CpuDecodeKernel
from kvhive.model.prefill_kernel import CpuPrefillKernel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttentionKernels:
    """The kernels decode and prefill attention run through (C++ on CPU, Triton on CUDA); None: torch
    on gathered K/V for that path."""

    decode: Any | None          # CpuDecodeKernel | TritonDecodeKernel
    prefill: Any | None         # CpuPrefillKernel | TritonPrefillKernel


def choose_attention_kernels(config: ModelConfig, dtype: torch.dtype, device: torch.device, native_attention: bool,
                             isa: str | None, measure_attention: bool, backend: str = "auto") -> AttentionKernels:
    """The kernels for this model, pool dtype and device (``isa``: the CPU ISA level, None: the CPU's
    best); ``measure_attention``: a bf16 pool's prefill goes to torch where torch measures faster.
    ``backend``: auto, triton or torch (ValueError where ``triton`` cannot run here)."""
    if backend == "torch" or not native_attention:
        return AttentionKernels(None, None)
    if backend == "triton" or device.type == "cuda":
        return _triton_kernels(config, dtype, device, required=backend == "triton")
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return AttentionKernels(None, None)
    return _cpu_kernels(config, dtype, isa, measure_attention)


def _cpu_kernels(config: ModelConfig, dtype: torch.dtype, isa: str | None, measure_attention: bool) -> AttentionKernels:
    """The C++ kernels for this CPU (None where no compiler builds them or the shape is not supported)."""
    decode = CpuDecodeKernel.load(isa)
    prefill = CpuPrefillKernel.load(isa)
    if prefill is not None and not prefill.supports(dtype, config.num_heads, config.num_kv_heads, config.head_dim):
        prefill = None
    if prefill is not None and dtype == torch.bfloat16:
        # Two candidates for bf16 prefill attention: the kernel's faster bf16 path, and torch's
        # (AMX-backed where the CPU has AMX); measured here on a synthetic layer.
        path = prefill.pick_bf16_path()
        if measure_attention and torch_prefill_is_faster(prefill, dtype, config.num_heads, config.num_kv_heads,
                                                         config.head_dim):
            prefill = None
            logger.info("bfloat16 prefill attention: torch on gathered K/V (faster here than the C++ kernel)")
        else:
            logger.info("bfloat16 prefill attention: the C++ kernel's %s path (faster here)", path)
    return AttentionKernels(decode, prefill)


def _triton_kernels(config: ModelConfig, dtype: torch.dtype, device: torch.device, required: bool) -> AttentionKernels:
    """The Triton paged kernels for this device and shape. Where one cannot run (Triton missing or
    failing to compile, a CPU without ``TRITON_INTERPRET=1``, an unsupported shape): ValueError when
    ``required``, else None for that path with a log line (the gather path runs)."""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        reason = "Triton kernels run on CPU only under TRITON_INTERPRET=1"
        if required:
            raise ValueError(f"--attention-backend triton: {reason}")
        logger.info("attention: %s; torch on gathered K/V", reason)
        return AttentionKernels(None, None)
    found = []
    for module, name in (("kvhive.model.triton_decode", "TritonDecodeKernel"),
                         ("kvhive.model.triton_prefill", "TritonPrefillKernel")):
        kernel, why = _load_triton(module, name, config, dtype, device)
        if kernel is None:
            if required:
                raise ValueError(f"--attention-backend triton: {why}")
            logger.warning("attention: %s; that path gathers K/V for torch instead", why)
        found.append(kernel)
    return AttentionKernels(*found)


def _load_triton(module: str, name: str, config: ModelConfig, dtype: torch.dtype,
                 device: torch.device) -> tuple[Any | None, str]:
    """(the kernel, "") or (None, why it cannot run here)."""
    try:
        kernel_class = getattr(importlib.import_module(module), name)
    except ImportError as exc:
        return None, f"{name} is unavailable ({exc})"
    kernel = kernel_class.load(device)
    if kernel is None:
        return None, f"{name} cannot compile on {device}"
    if not kernel.supports(dtype, config.num_heads, config.num_kv_heads, config.head_dim):
        return None, (f"{name} does not support {dtype} with {config.num_heads} heads, {config.num_kv_heads} "
                      f"KV heads of size {config.head_dim}")
    return kernel, ""
