"""PoolBlocks: a store object's bytes over one pool, or a main and a window pool, are the same."""

from __future__ import annotations

import torch

from kvhive.connector.pool_blocks import PoolBlocks

FLAGS = (True, True, False, True, False)         # window, window, global, window, global
SHAPE = (2, 4, 2, 3)                              # K/V, block_size, kv_heads, head_dim


def _pools(one: torch.Tensor) -> PoolBlocks:
    """A main and a window pool holding ``one``'s blocks (window part of block i in window block i)."""
    flags = torch.tensor(FLAGS)
    blocks = PoolBlocks(one[:, ~flags].contiguous())
    blocks.add_window_pool(one[:, flags].contiguous(), FLAGS)
    return blocks


def test_gather_gives_the_one_pool_rows() -> None:
    one = torch.randn(6, len(FLAGS), *SHAPE)
    two = _pools(one)
    assert two.block_bytes == one[0].nbytes
    got = two.gather([4, 1], [4, 1])
    assert got.numpy().tobytes() == one[[4, 1]].numpy().tobytes()


def test_loads_fill_main_blocks_and_the_wanted_window_blocks_only() -> None:
    one = torch.randn(6, len(FLAGS), *SHAPE)
    two = _pools(torch.zeros_like(one))
    two.write_block(2, 0, one[2].numpy().tobytes())                   # no window part wanted
    two.write_block(3, 5, one[3].numpy().tobytes())
    targets = two.load_targets([1, 4], [0, 4])
    for layer in range(len(FLAGS)):
        two.copy_layer(layer, one[[1, 4], layer], targets)
    window, main = two.window, two.kv
    assert torch.equal(main[[1, 2, 3, 4]], one[[1, 2, 3, 4]][:, [2, 4]])
    assert torch.equal(window[5], one[3][[0, 1, 3]]) and torch.equal(window[4], one[4][[0, 1, 3]])
    assert not window[[0, 1, 2, 3]].any()
