"""Host tensors on transparent huge pages, for the KV pool.

Decode attention reads every running request's blocks each step from wherever its block table put
them in a pool of gigabytes: eight 600-token requests read 221 MB of float32 K/V in 16-row pieces
spread over tens of thousands of 4 KiB pages, nearly each one a TLB miss. On a 2-core AVX2 EPYC
with the default 2 GiB pool, 2 MiB pages took the attention kernel alone 0.93-0.98x the time and
whole decode steps 0.94-0.99x for eight requests (0.98-1.01x for one of 1,600 tokens), paired step
for step in three runs.

``zeros`` allocates a tensor at a 2 MiB boundary and asks the kernel for huge pages
(``madvise(MADV_HUGEPAGE)``, which Linux honours where transparent huge pages are ``always`` or
``madvise``) before anything touches it, then zeroes it, so its pages are faulted in as huge pages
where the kernel has them. Where the advice cannot be given (not Linux, no libc, huge pages off:
``madvise`` fails), or the tensor is small or on another device, it is ``torch.zeros``; nothing
else differs, and the caller learns which it got (for the startup log).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import sys
from collections.abc import Sequence

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
# Tensors smaller than this stay on ordinary pages: a few huge pages save little, and alignment
# costs up to one huge page more.
MIN_BYTES = 8 * HUGE_PAGE


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library with ``madvise`` declared (None: not Linux, or none to load)."""
    if sys.platform != "linux":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    except (OSError, AttributeError):
        return None
    return libc


def _madvise(address: int, length: int) -> bool:
    """``madvise(address, length, MADV_HUGEPAGE)``; False where it cannot be called or fails."""
    libc = _libc()
    return libc is not None and libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_HUGEPAGE) == 0


def zeros(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str = "cpu",
          huge_pages: bool = True) -> tuple[torch.Tensor, bool]:
    """A zeroed tensor of ``shape`` and ``dtype`` on ``device``, and whether huge pages were asked
    for it and granted the advice (another device than the CPU, or ``huge_pages=False``: as
    ``torch.zeros``)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not huge_pages or nbytes < MIN_BYTES or torch.device(device).type != "cpu":
        return torch.zeros(*shape, dtype=dtype, device=device), False
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    aligned = raw[start:start + nbytes]
    advised = _madvise(aligned.data_ptr(), nbytes // HUGE_PAGE * HUGE_PAGE)
    return aligned.view(dtype).view(*shape).zero_(), advised   # the first touch faults pages in


def describe(advised: bool) -> str:
    """The pages a tensor from ``zeros`` is on, in words."""
    return "2 MiB pages advised" if advised else "4 KiB pages"
