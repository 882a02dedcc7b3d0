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

An 8-bit pool (``--kv-cache-dtype int8|fp8``, ``kvhive.model.kv_quant``) is read by a C++ kernel
only where the kernel says it reads that format (``supports_kv``); elsewhere torch dequantises the
gathered rows (logged once, with the reason). The Triton kernels read float pools only: with
``auto`` on CUDA an 8-bit pool takes the torch path (logged); ``triton`` is refused before this
(``kvhive.core.kv_cache_dtype``), and here too (ValueError). The bf16 timing of torch against the
prefill kernel is not run for an 8-bit pool: torch would dequantise the whole context each chunk.
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
                             isa: str | None, measure_attention: bool, backend: str = "auto",
                             kv_dtype: str | None = None) -> AttentionKernels:
    """The kernels for this model, model dtype, pool format and device (``isa``: the CPU ISA level,
    None: the CPU's best); ``measure_attention``: a bf16 pool's prefill goes to torch where torch
    measures faster. ``backend``: auto, triton or torch (ValueError where ``triton`` cannot run here).
    ``kv_dtype``: the pool's 8-bit format ("int8" or "fp8"), None for a float pool."""
    if backend == "torch" or not native_attention:
        return AttentionKernels(None, None)
    if kv_dtype is not None and (backend == "triton" or device.type == "cuda"):
        if backend == "triton":
            raise ValueError(f"--attention-backend triton reads float KV pools only, not --kv-cache-dtype {kv_dtype}")
        logger.info("attention: the Triton kernels do not read a %s KV pool; torch on the dequantised K/V", kv_dtype)
        return AttentionKernels(None, None)
    if backend == "triton" or device.type == "cuda":
        return _triton_kernels(config, dtype, device, required=backend == "triton")
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return AttentionKernels(None, None)
    return _cpu_kernels(config, dtype, isa, measure_attention and kv_dtype is None, kv_dtype)


def _reading_kv(kernel: Any | None, kv_dtype: str | None, path: str) -> Any | None:
    """``kernel`` where it reads the pool's format (a float pool: always), else None, logged."""
    if kernel is None or kernel.supports_kv(kv_dtype):
        return kernel
    logger.info("%s attention: the C++ kernel (%s) does not read %s KV pools; torch on the dequantised K/V",
                path, kernel.describe(torch.device("cpu")), kv_dtype)
    return None


def _cpu_kernels(config: ModelConfig, dtype: torch.dtype, isa: str | None, measure_attention: bool,
                 kv_dtype: str | None = None) -> AttentionKernels:
    """The C++ kernels for this CPU (None where no compiler builds them, the shape is not supported
    or the kernel does not read the pool's 8-bit format ``kv_dtype``)."""
    decode = _reading_kv(CpuDecodeKernel.load(isa), kv_dtype, "decode")
    prefill = _reading_kv(CpuPrefillKernel.load(isa), kv_dtype, "prefill")
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
