"""Decode attention read straight from the paged KV pool by a small C++ kernel (CPU).

One work item per (KV head, chunk of keys, sequences): sequences whose chunk lies in the same pool
blocks (a cached prefix shared by a batch) share an item, which reads each K/V row once for all of
them. Every (sequence, head, chunk) leaves a partial softmax; the partials merge by their maxima.

The library is built per ISA level (``kvhive.model.cpu``). At ``avx512_bf16``, ``avx512`` and
``avx2`` an item with head_dim 64 and at most 4 queries per KV head (SmolLM2's 3) runs an online
softmax over steps of 32 keys in vector registers: bfloat16 rows are widened to float32 (at
``avx512_bf16`` the scores use ``vdpbf16ps``), float32 compute, one read of each K/V row for all the
item's sequences. Other shapes, and the ``portable`` level, take a generic path that the compiler
vectorises. Built once per machine by ``kvhive.model.native``; without a compiler the runner
gathers the blocks and uses SDPA instead.

The pool's rows may also be packed 8-bit rows (``kvhive.model.kv_quant``: int8 or float8 E4M3 codes
and a bfloat16 scale per token and head), read by float32 or bfloat16 queries alike. They are
dequantised in registers as they are read (int8 widened, E4M3 through its float16 bits; the generic
path by a table), with each row's scale factored out of its sums: score = scale_k * (q . codes),
and a key's probability times scale_v weighs its V codes. Every dequantised value is exact in
float32, so only the rounding order differs from attention over ``dequantize_rows(pool)``.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from kvhive.model.cpu import resolve
from kvhive.model.kv_quant import SCALE_BYTES, pool_dtype
from kvhive.model.native import DEFAULT_FLAGS, build_library, kernel_source

if TYPE_CHECKING:
    from kvhive.model.attention import DecodeBatch


class _KernelArgs(ctypes.Structure):
    _fields_ = [("q", ctypes.c_void_p), ("q_stride", ctypes.c_int64), ("pool", ctypes.c_void_p),
                ("tables", ctypes.c_void_p), ("ctx_lens", ctypes.c_void_p)] + [
        (name, ctypes.c_int64) for name in ("n_seqs", "max_blocks", "num_layers", "layer", "block_size",
                                            "kv_heads", "group", "head_dim")] + [
        ("scale", ctypes.c_float), ("chunk", ctypes.c_int64), ("out", ctypes.c_void_p),
        ("ws", ctypes.c_void_p), ("n_threads", ctypes.c_int)]


# The library's query types (q_is_bf16) and pool row types (decode.cpp's KvType: a float pool's code
# is its query type's; 2 and up are the packed 8-bit formats of kvhive.model.kv_quant).
_QUERY_TYPES = {torch.float32: 0, torch.bfloat16: 1}
_KV_TYPES = {**_QUERY_TYPES, pool_dtype("int8"): 2, pool_dtype("fp8"): 3}


class CpuDecodeKernel:
    """Decode attention read straight from the pool (no gather) on CPU: float32 or bfloat16 queries
    over a pool of their own type or of packed 8-bit rows (int8, fp8)."""

    CHUNK_KEYS = 256        # keys per work item; items are (kv head, chunk, sequences sharing it)

    def __init__(self, lib: ctypes.CDLL, isa: str) -> None:
        self.isa = isa                  # the ISA level the library was built for (kvhive.model.cpu)
        self._fn = lib.kvhive_decode_attention
        self._fn.argtypes = [ctypes.POINTER(_KernelArgs), ctypes.c_int, ctypes.c_int]
        self._fn.restype = ctypes.c_int

    @classmethod
    def load(cls, isa: str | None = None, cache_dir: str | None = None) -> CpuDecodeKernel | None:
        """The kernel built for ISA level ``isa`` (default: the CPU's best), compiled on first use per
        machine into cache_dir; None without a compiler."""
        isa = resolve(isa)
        lib = build_library("decode", kernel_source("decode"), (*DEFAULT_FLAGS, "-ffast-math"), cache_dir, isa)
        return None if lib is None else cls(lib, isa)

    @staticmethod
    def workspace_size(num_seqs: int, max_context: int, num_heads: int, head_dim: int) -> int:
        """float32 values of partials for a decode batch."""
        chunks = -(-max_context // CpuDecodeKernel.CHUNK_KEYS) + 1
        return num_seqs * num_heads * chunks * (head_dim + 2)

    def workspace(self, num_seqs: int, max_context: int, num_heads: int, head_dim: int) -> torch.Tensor:
        """A float32 partials buffer for a decode batch of this shape (``DecodeBatch.workspace``)."""
        return torch.empty(self.workspace_size(num_seqs, max_context, num_heads, head_dim), dtype=torch.float32)

    def supports_kv(self, kv_dtype: str | None) -> bool:
        """Whether the library reads a pool of this 8-bit format (``kvhive.model.kv_quant``: "int8" or
        "fp8"); None: a float pool, which it always reads."""
        return kv_dtype in (None, "int8", "fp8")

    def describe(self, device: torch.device) -> str:
        """The path's name for the runner's startup log and /version."""
        return f"C++ {self.isa}"

    @staticmethod
    def chunk_keys(block_size: int) -> int:
        """Keys per work item: CHUNK_KEYS rounded up to whole blocks."""
        return -(-CpuDecodeKernel.CHUNK_KEYS // block_size) * block_size

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor, layer: int, dec: DecodeBatch) -> torch.Tensor:
        """Attention of q [N, heads, head_dim] (rows may be strided) -> [N, heads * head_dim], of q's
        dtype (float32 or bfloat16). kv_cache holds rows of q's dtype, or packed 8-bit rows of
        head_dim + 2 elements (``kvhive.model.kv_quant``)."""
        n, heads, head_dim = q.shape
        _, num_layers, _, block_size, kv_heads, row = kv_cache.shape
        q_type, kv_type = _QUERY_TYPES.get(q.dtype), _KV_TYPES.get(kv_cache.dtype, -1)
        packed = kv_type >= 2
        if q_type is None or (kv_type != q_type and not packed) or row != head_dim + packed * SCALE_BYTES:
            raise ValueError(f"decode kernel: {q.dtype} queries of head_dim {head_dim} cannot read a "
                             f"{kv_cache.dtype} pool of rows of {row}")
        out = torch.empty(n, heads * head_dim, dtype=q.dtype)
        args = _KernelArgs(q.data_ptr(), q.stride(0), kv_cache.data_ptr(), dec.block_tables.data_ptr(),
                           dec.context_lens.data_ptr(), n, dec.block_tables.shape[1], num_layers, layer,
                           block_size, kv_heads, heads // kv_heads, head_dim, head_dim ** -0.5,
                           self.chunk_keys(block_size), out.data_ptr(), dec.workspace.data_ptr(),
                           torch.get_num_threads())
        if self._fn(ctypes.byref(args), q_type, kv_type):
            raise ValueError(f"decode kernel: unsupported shape (group {heads // kv_heads}, "
                             f"head_dim {head_dim})")
        return out
