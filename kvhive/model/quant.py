"""Matmul straight from GGUF's quantised weights (Q4_1, Q8_0) for steps with few rows.

Decode reads every weight once per step, so its speed is the bytes it reads: the dequantised
float32 copy of SmolLM2's layers and LM head is ~540 MB, the file's own Q4_1/Q8_0 blocks ~90 MB.
``QuantWeight`` keeps a GGUF tensor's blocks (nibbles or int8 plus float32 scales converted exactly
from the file's float16); ``QuantMatmul`` multiplies float32 rows by them in a small C++ kernel.
Each weight is rebuilt as ``d * q + m`` in float32, exactly what ``gguf.quants.dequantize``
computes (``d`` is a float16 value, so ``d * q`` is exact and only the ``+ m`` rounds), so results
differ from the dense path only in summation order.
Prefill (many rows) stays on the dense oneDNN copy, where the CPU is compute-bound instead.

The kernel is built per ISA level (``kvhive.model.cpu``): AVX-512 (Q4_1 weights looked up in a
per-block table of 16 values), AVX2 + FMA (nibbles converted and scaled 8 at a time) and plain C++
that the compiler vectorises. Each multiplies a tile of rows x features per pass over the blocks,
so a rebuilt weight serves every row of a step and an x load several features.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import numpy as np
import torch

from kvhive.model.cpu import resolve
from kvhive.model.native import DEFAULT_FLAGS, build_library, kernel_source

logger = logging.getLogger(__name__)

QK = 32                                   # weights per GGUF block (Q4_1 and Q8_0)
KINDS = {"Q4_1": 0, "Q8_0": 1}
_BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}   # float16 d [, float16 m], then the packed values


@dataclass(frozen=True)
class QuantWeight:
    """A [out_features, in_features] weight as GGUF blocks along in_features.

    ``qs`` is uint8 [out, in / 32, 16] for Q4_1 (byte j holds value j in its low nibble and value
    j + 16 in its high nibble, as in the file) or int8-as-uint8 [out, in / 32, 32] for Q8_0; ``d``
    and ``m`` are float32 [out, in / 32] holding the file's float16 values (``m`` is zero for Q8_0).
    The kernel relies on that: with ``d`` a float16 value, ``d * q`` is exact in float32.
    """

    kind: str
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features)."""
        return self.qs.shape[0], self.qs.shape[1] * QK

    @classmethod
    def from_gguf(cls, kind: str, raw: np.ndarray, out_features: int, in_features: int) -> QuantWeight:
        """From a GGUF tensor's raw bytes (row-major, ``in_features / 32`` blocks per row)."""
        if kind not in KINDS:
            raise ValueError(f"unsupported quantisation {kind!r}")
        if in_features % QK:
            raise ValueError(f"in_features {in_features} is not a multiple of {QK}")
        blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(out_features, in_features // QK,
                                                                   _BLOCK_BYTES[kind])
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        if kind == "Q4_1":
            m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            qs = blocks[..., 4:]
        else:
            m = np.zeros_like(d)
            qs = blocks[..., 2:]
        return cls(kind, torch.from_numpy(np.ascontiguousarray(qs)), torch.from_numpy(d), torch.from_numpy(m))

    def take_rows(self, index: np.ndarray) -> QuantWeight:
        """The weight with its output rows reordered (quantisation blocks run along the input axis)."""
        idx = torch.from_numpy(np.asarray(index, dtype=np.int64))
        return QuantWeight(self.kind, self.qs[idx].contiguous(), self.d[idx].contiguous(),
                           self.m[idx].contiguous())

    @staticmethod
    def concat(parts: list[QuantWeight]) -> QuantWeight:
        """Parts stacked along the output axis (fused QKV, fused gate+up)."""
        kinds = {p.kind for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot fuse weights of different quantisations {sorted(kinds)}")
        return QuantWeight(parts[0].kind, torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]),
                           torch.cat([p.m for p in parts]))

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in], bit-equal to ``gguf.quants.dequantize`` of the same blocks."""
        if self.kind == "Q4_1":
            q = torch.cat([self.qs & 0x0F, self.qs >> 4], dim=-1).float()
        else:
            q = self.qs.view(torch.int8).float()
        return (self.d[..., None] * q + self.m[..., None]).reshape(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes held (values and scales)."""
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m))


class _Args(ctypes.Structure):
    _fields_ = [("x", ctypes.c_void_p), ("x_stride", ctypes.c_int64), ("rows", ctypes.c_int64),
                ("qs", ctypes.c_void_p), ("d", ctypes.c_void_p), ("m", ctypes.c_void_p),
                ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("kind", ctypes.c_int),
                ("residual", ctypes.c_void_p), ("res_stride", ctypes.c_int64),
                ("out", ctypes.c_void_p), ("n_threads", ctypes.c_int),
                ("x_bf16", ctypes.c_int), ("res_bf16", ctypes.c_int)]


_NATIVE_DTYPES = (torch.float32, torch.bfloat16)     # read and written by the kernel itself


class QuantMatmul:
    """``residual + x @ W.T`` for x [rows, in] (float32 or bfloat16) and a ``QuantWeight`` W, on CPU."""

    def __init__(self, lib: ctypes.CDLL, isa: str) -> None:
        self.isa = isa                  # the ISA level the library was built for (kvhive.model.cpu)
        self._fn = lib.kvhive_qmatmul
        self._fn.argtypes = [ctypes.POINTER(_Args)]
        self._fn.restype = ctypes.c_int

    @classmethod
    def load(cls, isa: str | None = None, cache_dir: str | None = None) -> QuantMatmul | None:
        """The kernel built for ISA level ``isa`` (default: the CPU's best; ``portable`` is plain
        C++); None without a compiler."""
        isa = resolve(isa)
        # No -ffast-math, no contraction: d * q + m must round twice, as gguf's numpy code does.
        flags = (*DEFAULT_FLAGS, "-ffp-contract=off")
        lib = build_library("qmatmul", kernel_source("qmatmul"), flags, cache_dir, isa)
        return None if lib is None else cls(lib, isa)

    def __call__(self, x: torch.Tensor, w: QuantWeight, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] (rows may be strided) -> [rows, out] in x's dtype.

        float32 and bfloat16 x, residual and output are read and written by the kernel (sums in
        float32, the residual added in float32, one rounding to bfloat16); other dtypes go through
        float32 copies.
        """
        n, k = w.shape
        dtype = x.dtype
        if dtype not in _NATIVE_DTYPES:
            x = x.float()
        if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
            raise ValueError(f"x must be [rows, {k}] with contiguous rows, got {tuple(x.shape)}")
        res = None
        if residual is not None:
            res = residual if residual.dtype in _NATIVE_DTYPES else residual.float()
            if res.shape != (x.shape[0], n) or res.stride(1) != 1:
                raise ValueError(f"residual must be [{x.shape[0]}, {n}] with contiguous rows")
        out = torch.empty(x.shape[0], n, dtype=x.dtype)
        args = _Args(x.data_ptr(), x.stride(0), x.shape[0], w.qs.data_ptr(), w.d.data_ptr(), w.m.data_ptr(),
                     n, k, KINDS[w.kind], 0 if res is None else res.data_ptr(),
                     0 if res is None else res.stride(0), out.data_ptr(), torch.get_num_threads(),
                     int(x.dtype == torch.bfloat16), int(res is not None and res.dtype == torch.bfloat16))
        if self._fn(ctypes.byref(args)):
            raise ValueError(f"qmatmul: unsupported shape {w.kind} {n}x{k}")
        return out if out.dtype == dtype else out.to(dtype)
