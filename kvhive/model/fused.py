"""The decoder layer's small elementwise steps fused into one C++ call each (CPU).

RMSNorm, SiLU(gate) * up and rotary embedding are a handful of tiny torch ops each; at decode the
per-op dispatch (10–25 µs) costs more than the arithmetic, and at prefill every op is another pass
over the activations. Each function here is one pass, with the same roundings as the torch
composites in ``kvhive.model.llama`` (statistics and products in float32, rounded to the model's
dtype where torch rounds), so float32 results agree to float32 rounding and bfloat16 results bit
for bit in the usual case. Rows are split over OpenMP threads when there are many.

Built per ISA level (``kvhive.model.cpu``) by ``kvhive.model.native``: SiLU has AVX-512 and AVX2 +
FMA paths (a polynomial exp); RMSNorm, RoPE and the ``portable`` level are loops the compiler
vectorises for the level. ``FusedOps.load()`` is None without a compiler.
"""

from __future__ import annotations

import ctypes

import torch

from kvhive.model.cpu import resolve
from kvhive.model.native import DEFAULT_FLAGS, build_library, kernel_source

_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class FusedOps:
    """One-call RMSNorm, SiLU-and-multiply and in-place RoPE for float32 / bfloat16 CPU tensors."""

    def __init__(self, lib: ctypes.CDLL, isa: str) -> None:
        self.isa = isa                  # the ISA level the library was built for (kvhive.model.cpu)
        self._rms = lib.kvhive_rms_norm
        self._rms.argtypes = [_PTR, _I64, _PTR, _PTR, _I64, _I64, _F32, ctypes.c_int, ctypes.c_int]
        self._silu = lib.kvhive_silu_mul
        self._silu.argtypes = [_PTR, _I64, _PTR, _I64, _I64, ctypes.c_int, ctypes.c_int]
        self._rope = lib.kvhive_rope
        self._rope.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, ctypes.c_int, ctypes.c_int]
        for fn in (self._rms, self._silu, self._rope):
            fn.restype = None

    @classmethod
    def load(cls, isa: str | None = None, cache_dir: str | None = None) -> FusedOps | None:
        """The ops built for ISA level ``isa`` (default: the CPU's best); None without a compiler."""
        isa = resolve(isa)
        lib = build_library("fused", kernel_source("fused"), (*DEFAULT_FLAGS, "-ffast-math"), cache_dir, isa)
        return None if lib is None else cls(lib, isa)

    @staticmethod
    def _threads(rows: int) -> int:
        return 1 if rows < 16 else torch.get_num_threads()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [rows, h] (rows may be strided) -> weight * normalised x, a new contiguous tensor."""
        rows, h = x.shape
        if x.stride(1) != 1 or not weight.is_contiguous() or weight.dtype != x.dtype:
            raise ValueError("rms_norm: x needs contiguous rows and a weight of its dtype")
        out = torch.empty(rows, h, dtype=x.dtype)
        self._rms(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), rows, h, eps,
                  int(x.dtype == torch.bfloat16), self._threads(rows))
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [rows, 2 * inter] (gate, then up) -> silu(gate) * up [rows, inter]."""
        rows, width = gate_up.shape
        if gate_up.stride(1) != 1 or width % 2:
            raise ValueError("silu_mul: gate_up needs contiguous rows of even width")
        out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
        self._silu(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, width // 2,
                   int(gate_up.dtype == torch.bfloat16), self._threads(rows))
        return out

    def prepare_rope(self, positions: torch.Tensor, cos: torch.Tensor,
                     sin_signed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A step's RoPE arguments for ``rope``, checked once (the kernel reads the tables unchecked)."""
        positions = positions.to(torch.int64).contiguous()
        if positions.numel() and int(positions.max()) >= cos.shape[0]:
            raise IndexError(f"position {int(positions.max())} is past the model's {cos.shape[0]} rotary positions")
        return positions, cos, sin_signed

    def rope(self, qk: torch.Tensor, prepared: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """``rope_`` with a step's ``prepare_rope`` arguments."""
        self.rope_(qk, *prepared)

    def rope_(self, qk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> None:
        """Rotate-half RoPE in place on qk [rows, heads, head_dim] (rows may be strided).

        cos / sin_signed are the model's [max_positions, head_dim] tables (``rope_tables``);
        positions is int64 [rows].
        """
        rows, heads, hd = qk.shape
        if qk.stride(2) != 1 or qk.stride(1) != hd or hd % 2 or hd > 512:
            raise ValueError("rope_: qk needs contiguous heads of an even head_dim <= 512")
        if positions.dtype != torch.int64 or not positions.is_contiguous() or positions.shape[0] != rows:
            raise ValueError("rope_: positions must be contiguous int64, one per row")
        if cos.dtype != qk.dtype or not (cos.is_contiguous() and sin_signed.is_contiguous()):
            raise ValueError("rope_: tables must be contiguous and of qk's dtype")
        self._rope(qk.data_ptr(), qk.stride(0), rows, heads * hd, positions.data_ptr(), cos.data_ptr(),
                   sin_signed.data_ptr(), hd | (int(qk.dtype == torch.bfloat16) << 16), self._threads(rows))
