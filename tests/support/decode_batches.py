"""Decode batches for the C++ decode kernel's tests: the kernel at an ISA level, shuffled pool
blocks handed out to block tables, and a DecodeBatch over tables padded with block 0 as the runner
pads them.

Usable by any test file (pytest puts tests/ on sys.path): ``from support.decode_batches import ...``.
"""

from __future__ import annotations

import pytest
import torch

from kvhive.model.attention import DecodeBatch
from kvhive.model.decode_kernel import CpuDecodeKernel


def kernel_at(level: str) -> CpuDecodeKernel:
    """The decode kernel built for ISA level ``level`` (the test skips without a compiler)."""
    kern = CpuDecodeKernel.load(level)
    if kern is None:
        pytest.skip("no C++ compiler")
    assert kern.isa == level
    return kern


class BlockTables:
    """A pool's blocks handed out in a shuffled order (tables are never contiguous or sorted)."""

    def __init__(self, num_blocks: int, block_size: int, gen: torch.Generator) -> None:
        self.block_size = block_size
        self.free = torch.randperm(num_blocks, generator=gen).tolist()

    def table(self, num_tokens: int, prefix: list[int] | None = None) -> list[int]:
        """Blocks for num_tokens tokens: prefix's blocks first, then fresh ones."""
        table = list(prefix or [])
        while len(table) * self.block_size < num_tokens:
            table.append(self.free.pop())
        return table


def padded_batch(kernel: CpuDecodeKernel, tables: list[list[int]], lengths: list[int], block_size: int,
                 heads: int, head_dim: int, padding: int = 1) -> DecodeBatch:
    """A decode batch whose tables are padded with block 0 (``padding`` entries past the longest)."""
    n = len(tables)
    max_blocks = max(len(t) for t in tables) + padding
    padded = torch.zeros(n, max_blocks, dtype=torch.int64)
    for i, t in enumerate(tables):
        padded[i, :len(t)] = torch.tensor(t)
    workspace = torch.empty(CpuDecodeKernel.workspace_size(n, max_blocks * block_size, heads, head_dim))
    return DecodeBatch(num_seqs=n, block_tables=padded, context_lens=torch.tensor(lengths, dtype=torch.int64),
                       mask=None, kernel=kernel, workspace=workspace)
