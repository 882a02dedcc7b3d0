"""Prefill attention read straight from the paged KV pool by a C++ flash-attention kernel (CPU).

A prefill chunk of n new tokens at positions start_pos..start_pos+n-1 attends causally to every key
0..start_pos+n-1 of its sequence, which the layer has already written into the pool. The kernel
first packs each KV head's keys into tiles of 32 keys (transposed for the score products; a
bfloat16 pool's values too, while a float32 pool's are read where they lie), then runs one work
item per (KV head, tile of 16 query tokens): the group of query heads sharing a KV head are rows
of the same item, so each K/V tile is read once for all of them. Scores,
the running softmax and the output accumulators stay in float32; the output is in the queries' dtype
(the pool's, for a float pool).

The path depends on the ISA level the library is built for (``kvhive.model.cpu``):

* ``avx512_bf16`` and ``avx512``: 512-bit float32 for float32 pools. A bfloat16 pool has two paths,
  and the faster on this CPU is measured once (``pick_bf16_path``, a few milliseconds when the model
  runner starts): ``wide`` widens keys and values to float32 as their tiles are packed and runs the
  float32 kernel (its output is the float32 result rounded once); ``native`` runs the score and
  value products on ``vdpbf16ps`` (bf16 inputs, float32 sums; tiles packed in pairs of bf16) with
  the probabilities rounded to bf16, as flash attention does on GPUs (at ``avx512``: the AVX2 path).
  On an Intel Xeon with AMX the wide path took 9.5 ms where vdpbf16ps took 14.5 (1,600 new tokens,
  one layer of the default model); a CPU where vdpbf16ps is the faster keeps it.
* ``avx2`` (AVX2 + FMA), and bfloat16 pools at ``avx512``: 256-bit float32. A bfloat16 pool's keys
  and values are widened to float32 as they are packed (its workspace then takes 4 bytes an
  element) and the output is rounded back to bf16 (nearest even).
* ``portable``: no path; ``load`` returns None and attention falls back to torch.

8-bit pools (``--kv-cache-dtype int8|fp8``; the packed rows of ``kvhive.model.kv_quant``: head_dim
codes and a bfloat16 scale) are read at every SIMD level, with float32 or bfloat16 queries: each row
is dequantised into float32 as its tile is packed (int8 converted; an E4M3 byte read as float16
bits by F16C, 256 folded into the scale; both exact), so only the packed tiles are ever float32,
and the float32 kernel runs on them (16 lanes at ``avx512_bf16`` and ``avx512``, 8 at ``avx2``).
bf16 queries are widened as they are loaded and the output rounded once to bf16, as on the ``wide``
path; ``pick_bf16_path`` concerns bf16 pools only. ``supports_kv`` says which formats the library reads.

Built once per machine and level by ``kvhive.model.native``.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from kvhive.model.cpu import resolve
from kvhive.model.kv_quant import QUANTIZED_KV_DTYPES, canonical_kv_dtype, head_dim_of, pool_kv_dtype
from kvhive.model.native import build_library, kernel_source
from kvhive.model.timing import min_times

if TYPE_CHECKING:
    from kvhive.model.attention import PrefillSpan


class _Args(ctypes.Structure):
    _fields_ = [("q", ctypes.c_void_p), ("q_stride", ctypes.c_int64), ("pool", ctypes.c_void_p),
                ("table", ctypes.c_void_p)] + [
        (name, ctypes.c_int64) for name in ("n", "start_pos", "num_layers", "layer", "block_size",
                                            "kv_heads", "group", "head_dim")] + [
        ("scale", ctypes.c_float), ("out", ctypes.c_void_p), ("ws", ctypes.c_void_p),
        ("n_threads", ctypes.c_int)]


# Capability bits reported by the library (what it was compiled for): float32 pools, bfloat16 pools,
# bfloat16 tiles packed as float32 (the AVX2 path: 4 workspace bytes an element), and a second
# bfloat16 path widened to float32 at 16 lanes (AVX-512 builds), and 8-bit pools (int8 and fp8 rows).
_CAP_FLOAT32, _CAP_BFLOAT16, _CAP_BF16_AS_FLOAT32, _CAP_BF16_WIDE, _CAP_8BIT = 1, 2, 4, 8, 16
_TILE = 32              # keys per packed tile (both paths)
# The library's modes: a float32 pool, a bf16 pool on the build's own path, a bf16 pool widened,
# and 8-bit pools by (format, query dtype): each packed as float32 (4 workspace bytes an element).
_MODE_FLOAT32, _MODE_BF16, _MODE_BF16_WIDE = 0, 1, 2
_MODE_8BIT = {("int8", torch.float32): 3, ("int8", torch.bfloat16): 4,
              ("fp8", torch.float32): 5, ("fp8", torch.bfloat16): 6}
BF16_PATHS = ("auto", "native", "wide")


class CpuPrefillKernel:
    """Causal prefill attention from the pool: float32, bfloat16 and 8-bit pools (AVX2 + FMA or AVX-512)."""

    HEAD_DIMS = (16, 32, 64, 128)
    takes_score_rules = False       # 1/sqrt(head_dim) causal scores only (no soft-cap, no window)

    def __init__(self, lib: ctypes.CDLL, isa: str) -> None:
        self.isa = isa                  # the ISA level the library was built for (kvhive.model.cpu)
        self._fn = lib.kvhive_prefill_attention
        self._fn.argtypes = [ctypes.POINTER(_Args), ctypes.c_int]
        self._fn.restype = ctypes.c_int
        caps = lib.kvhive_prefill_caps
        caps.restype = ctypes.c_int
        bits = caps()
        self.dtypes = frozenset(dt for bit, dt in ((_CAP_FLOAT32, torch.float32), (_CAP_BFLOAT16, torch.bfloat16))
                                if bits & bit)
        # Bytes per packed K/V element of a bf16 pool: 4 where the bf16 tiles are widened to float32.
        self._bf16_packed_bytes = 4 if bits & _CAP_BF16_AS_FLOAT32 else 2
        self._has_wide = bool(bits & _CAP_BF16_WIDE) and torch.bfloat16 in self.dtypes
        self._reads_8bit = bool(bits & _CAP_8BIT)
        self._bf16_mode: int | None = None       # chosen on the first bf16 call (pick_bf16_path)
        self._ws = torch.empty(0, dtype=torch.uint8)

    @property
    def bf16_path(self) -> str:
        """Which bf16 path runs: ``native`` (the build's own: vdpbf16ps pairs, or AVX2 widened) or
        ``wide`` (widened to float32 at 16 lanes); ``auto`` until the first bf16 call measures them."""
        return {None: "auto", _MODE_BF16: "native", _MODE_BF16_WIDE: "wide"}[self._bf16_mode]

    def pick_bf16_path(self, path: str = "auto") -> str:
        """Fix the bf16 path: ``native``, ``wide`` (AVX-512 builds; else native) or ``auto``, the faster
        of the two on a synthetic layer of this CPU (a few milliseconds). Returns the path taken."""
        if path not in BF16_PATHS:
            raise ValueError(f"bf16 path must be one of {', '.join(BF16_PATHS)}, got {path!r}")
        if path == "native" or not self._has_wide:
            self._bf16_mode = _MODE_BF16
        elif path == "wide":
            self._bf16_mode = _MODE_BF16_WIDE
        else:
            self._bf16_mode = self._faster_bf16_mode()
        return self.bf16_path

    def _faster_bf16_mode(self) -> int:
        """Time both bf16 modes on one synthetic layer (768 cached + 128 new tokens, 9 heads on 3 KV
        heads of 64), one warm-up, then alternating, min of 5 each."""
        blocks, block_size, kv_heads, heads, hd, start, n = 56, 16, 3, 9, 64, 768, 128
        gen = torch.Generator().manual_seed(0)
        pool = torch.randn(blocks, 1, 2, block_size, kv_heads, hd, generator=gen).to(torch.bfloat16)
        q = torch.randn(n, heads, hd, generator=gen).to(torch.bfloat16)
        table = torch.randperm(blocks, generator=gen)
        modes = (_MODE_BF16, _MODE_BF16_WIDE)
        times = min_times([lambda m=m: self._run(q, pool, 0, table, start, m) for m in modes], 5)
        return modes[times.index(min(times))]

    @classmethod
    def load(cls, isa: str | None = None, cache_dir: str | None = None) -> CpuPrefillKernel | None:
        """The kernel built for ISA level ``isa`` (default: the CPU's best), compiled on first use per
        machine; None without a compiler or where the level has no path for any dtype."""
        isa = resolve(isa)
        lib = build_library("prefill", kernel_source("prefill"), cache_dir=cache_dir, isa=isa)
        if lib is None:
            return None
        kernel = cls(lib, isa)
        return kernel if kernel.dtypes else None

    def supports_kv(self, kv_dtype: str | None) -> bool:
        """Whether the library reads a pool of this 8-bit format (``kvhive.model.kv_quant``: "int8" or
        "fp8"); None: a float pool, which it always reads."""
        if kv_dtype is None:
            return True
        return self._reads_8bit and canonical_kv_dtype(kv_dtype) in QUANTIZED_KV_DTYPES

    def describe(self, device: torch.device) -> str:
        """The path's name for the runner's startup log and /version."""
        return f"C++ {self.isa}"

    def supports(self, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        """True where this kernel can run a model of these shapes and dtype."""
        return dtype in self.dtypes and head_dim in self.HEAD_DIMS and num_heads % num_kv_heads == 0

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_ids: torch.Tensor,
                 start_pos: int) -> torch.Tensor:
        """Attention of q [n, heads, head_dim] (rows may be strided) -> [n, heads * head_dim].

        block_ids (int64, contiguous) lists the pool blocks of positions 0..start_pos+n-1; the
        chunk's own K/V must already be written there. The output has q's dtype; an 8-bit pool
        (int8 or fp8 rows, ``kvhive.model.kv_quant``) takes float32 or bf16 queries.
        """
        return self._run(q, kv_cache, layer, block_ids, start_pos, self._mode(q.dtype, kv_cache))

    def _mode(self, q_dtype: torch.dtype, kv_cache: torch.Tensor) -> int:
        """The library's mode for queries of q_dtype over this pool (picks the bf16 path on first use)."""
        kv_dtype = pool_kv_dtype(kv_cache)
        if kv_dtype is not None:
            if not self.supports_kv(kv_dtype) or q_dtype not in (torch.float32, torch.bfloat16):
                raise ValueError(f"prefill kernel: no path for a {kv_dtype} pool with {q_dtype} queries at {self.isa}")
            return _MODE_8BIT[kv_dtype, q_dtype]
        if kv_cache.dtype == torch.bfloat16:
            if self._bf16_mode is None:
                self.pick_bf16_path()
            return self._bf16_mode
        return _MODE_FLOAT32

    def attend_spans(self, q: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                     spans: tuple[PrefillSpan, ...]) -> list[torch.Tensor]:
        """Every prefill span of a step (rows of q [T, heads, head_dim]), one call each: the output
        parts in span order, each [rows of its span, heads * head_dim] (the caller joins them once)."""
        return [self(q[s.begin:s.end], kv_cache, layer, s.block_ids, s.start_pos) for s in spans]

    def _run(self, q: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_ids: torch.Tensor,
             start_pos: int, mode: int) -> torch.Tensor:
        n, heads, head_dim = q.shape
        _, num_layers, _, block_size, kv_heads, row = kv_cache.shape
        quantized = mode in _MODE_8BIT.values()
        if (not quantized and q.dtype != kv_cache.dtype) or q.stride(2) != 1 or q.stride(1) != head_dim:
            raise ValueError("prefill kernel: q must match the pool's dtype with contiguous heads")
        if head_dim_of(kv_cache) != head_dim:
            raise ValueError(f"prefill kernel: pool rows of {row} elements do not hold head_dim {head_dim}")
        ctx = start_pos + n
        if block_ids.dtype != torch.int64 or not block_ids.is_contiguous() or block_ids.numel() * block_size < ctx:
            raise ValueError(f"prefill kernel: {block_ids.numel()} blocks cannot hold {ctx} tokens")
        out = torch.empty(n, heads * head_dim, dtype=q.dtype)
        args = _Args(q.data_ptr(), q.stride(0), kv_cache.data_ptr(), block_ids.data_ptr(), n, start_pos,
                     num_layers, layer, block_size, kv_heads, heads // kv_heads, head_dim, head_dim ** -0.5,
                     out.data_ptr(), self._workspace(ctx, kv_cache, head_dim, mode), torch.get_num_threads())
        if self._fn(ctypes.byref(args), mode):
            raise ValueError(f"prefill kernel: unsupported shape (head_dim {head_dim}, dtype {q.dtype})")
        return out

    def _workspace(self, keys: int, kv_cache: torch.Tensor, head_dim: int, mode: int) -> int:
        """Address of room for the packed K/V tiles of ``keys`` keys (grown as needed): float32 tiles
        for float32 pools, 8-bit pools and the wide bf16 path; the build's own width for bf16 pools."""
        kv_heads = kv_cache.shape[4]
        elem = self._bf16_packed_bytes if mode == _MODE_BF16 else 4
        need = 2 * kv_heads * -(-keys // _TILE) * _TILE * head_dim * elem
        if self._ws.numel() < need:
            self._ws = torch.empty(need + (need >> 2), dtype=torch.uint8)
        return self._ws.data_ptr()
