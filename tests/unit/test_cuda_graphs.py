"""Decode steps through per-bucket static buffers (``kvhive.model.cuda_graphs``): the padded,
static-shape forward gives the plain forward's tokens. On CPU it runs eagerly (``capture=False``);
where CUDA is present the captured graphs are checked against eager CUDA steps as well."""

from __future__ import annotations

import pytest
import torch
from support.runners import generate, make_runner, prompt
from support.tiny import dense_greedy, tiny_config, tiny_model

from kvhive.engine.runner import ModelRunner
from kvhive.model.attention import DecodeBatch
from kvhive.model.cuda_graphs import DecodeGraphs

PROMPTS = {"a": prompt(11, 20), "b": prompt(3, 21), "c": prompt(26, 22)}


def with_graphs(runner: ModelRunner, capture: bool) -> DecodeGraphs:
    max_blocks = -(-runner.config.max_position_embeddings // runner.block_size)
    runner.decode_graphs = DecodeGraphs(runner.model, runner.kv_cache, max_blocks, capture=capture)
    return runner.decode_graphs


def test_buckets_cover_batches_and_contexts() -> None:
    runner = make_runner(4, native=False)
    graphs = with_graphs(runner, capture=False)
    assert graphs.block_buckets == [16, 32, 64, 128]       # 512 positions in blocks of 4
    assert graphs.bucket(1, 1) == (1, 16)
    assert graphs.bucket(3, 17) == (4, 32)
    assert graphs.bucket(32, 128) == (32, 128)
    assert graphs.bucket(33, 1) is None and graphs.bucket(1, 129) is None
    assert DecodeGraphs(runner.model, runner.kv_cache, 512, max_rows=5, capture=False).row_buckets == [1, 2, 4, 8]


def test_padded_static_decode_matches_dense() -> None:
    runner, eager = make_runner(4, native=False), make_runner(4, native=False)
    graphs = with_graphs(runner, capture=False)
    got = generate(runner, PROMPTS, 8, join_at={"b": 2, "c": 5})
    for rid, p in PROMPTS.items():
        assert got[rid] == dense_greedy(runner.model, p, 8), rid
    assert graphs.num_steps > 0                       # the decode-only steps went through a bucket
    # Padding rows write only block 0 (never handed out): every other block equals the eager pool's.
    assert generate(eager, PROMPTS, 8, join_at={"b": 2, "c": 5}) == got
    torch.testing.assert_close(runner.kv_cache[1:], eager.kv_cache[1:])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_graphs_match_eager_cuda() -> None:
    model = tiny_model(tiny_config(), device="cuda")
    eager = ModelRunner(model, model.config, 256, 4, device="cuda", cuda_graphs=False)
    graphed = ModelRunner(model, model.config, 256, 4, device="cuda")
    assert eager.decode_graphs is None and graphed.decode_graphs is not None
    expected = generate(eager, PROMPTS, 12, join_at={"b": 2, "c": 5})
    assert generate(graphed, PROMPTS, 12, join_at={"b": 2, "c": 5}) == expected
    assert graphed.decode_graphs.num_steps > 0


def test_a_smaller_step_leaves_the_earlier_rows_slots_alone() -> None:
    # Four rows, then three in the same bucket: the last row's old slot (its block since handed to
    # another sequence, say) must not be written again by the padding row that replaces it.
    runner = make_runner(4, native=False)
    graphs = with_graphs(runner, capture=False)
    rows_per_block = runner.kv_cache.shape[1] * 2 * 4

    def step(blocks: list[int]) -> None:
        n = len(blocks)
        decode = DecodeBatch(n, torch.tensor([[b] for b in blocks]), torch.ones(n, dtype=torch.long),
                             mask=None, kernel=None, workspace=None)
        slots = torch.tensor([[b * rows_per_block, b * rows_per_block + 4] for b in blocks])
        graphs.forward(torch.full((n,), 7), torch.zeros(n, dtype=torch.long), slots, decode)

    step([3, 6, 7, 5])
    assert graphs.bucket(4, 1) == graphs.bucket(3, 1)
    runner.kv_cache[5].fill_(42.0)                     # block 5's new owner wrote it
    step([3, 6, 7])
    assert bool((runner.kv_cache[5] == 42.0).all())
