"""Which attention implementation a runner uses: kvhive's C++ CPU kernels, or torch.

On CPU with a float32 or bfloat16 pool, decode and prefill attention read the paged pool straight
through C++ kernels built for the CPU's ISA level (``kvhive.model.cpu``); elsewhere (CUDA, no
compiler, a shape the prefill kernel does not support, or ``native_attention`` off) torch runs it
on gathered K/V. A bfloat16 pool may measure, on a synthetic layer, whether torch's prefill beats
the kernel's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvhive.config import ModelConfig
from kvhive.model.attention import torch_prefill_is_faster
from kvhive.model.decode_kernel import CpuDecodeKernel
from kvhive.model.prefill_kernel import CpuPrefillKernel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttentionKernels:
    """The C++ kernels decode and prefill attention run through; None: torch for that path."""

    decode: CpuDecodeKernel | None
    prefill: CpuPrefillKernel | None


def choose_attention_kernels(config: ModelConfig, dtype: torch.dtype, device: torch.device, native_attention: bool,
                             isa: str | None, measure_attention: bool) -> AttentionKernels:
    """The kernels for this model, pool dtype and device (``isa``: the CPU ISA level, None: the CPU's
    best); ``measure_attention``: a bf16 pool's prefill goes to torch where torch measures faster."""
    native = native_attention and device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
    if not native:
        return AttentionKernels(None, None)
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
