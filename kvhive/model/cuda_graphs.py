"""CUDA graphs of the decode step: the forward pass replayed instead of launched kernel by kernel.

A decode step of a small model is launch-bound on a GPU: each layer is ~25 small kernels issued
from Python, so the step costs ~9 ms (H100, SmolLM2-135M) for well under 1 ms of GPU work. A graph
replays the whole recorded step with one launch.

A graph fixes every shape and address, so each one serves a bucket: up to ``rows`` decode rows
whose contexts fit in ``blocks`` pool blocks. The step's inputs are copied into the bucket's static
buffers, the rows past the real ones padded: token 0 at position 0, writing its K/V into pool block
0 (never handed out, see ``kvhive.kv.pool``) and attending to that block's first key only. Decode
attention runs through the runner's decode kernel where it has one (the Triton paged kernel on
CUDA, whose grid depends only on the bucket's shape), else over gathered K/V with a mask built from
the context lengths inside the graph. All buckets are captured up front
(``capture_all``, when the engine starts): a capture must not overlap CUDA work from other threads,
such as the KV connector's loads. The graphs share one memory pool.

With ``capture=False`` the same padded, static-shape forward runs eagerly; tests use it on CPU
to check the padding against the plain forward.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch

from kvhive.model.attention import AttnMetadata, DecodeBatch, decode_mask
from kvhive.model.llama import LlamaModel

ROW_BUCKETS = (1, 2, 4, 8, 16, 32)
MIN_BLOCK_BUCKET = 16


@dataclass
class _Graph:
    """One bucket's static inputs, its output and (when captured) the graph that computes it."""

    input_ids: torch.Tensor         # [rows]
    positions: torch.Tensor         # [rows]
    slot_rows: torch.Tensor         # [rows, 2]
    block_tables: torch.Tensor      # [rows, blocks]
    context_lens: torch.Tensor      # [rows]
    hidden: torch.Tensor | None     # [rows, hidden] after a run
    graph: torch.cuda.CUDAGraph | None
    rows_used: int = 0              # real rows of the last step; the rest are padding


class DecodeGraphs:
    """Decode-only steps through per-bucket CUDA graphs (the runner keeps steps that load KV layer by
    layer, or hold prefill chunks, eager)."""

    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, max_blocks_per_seq: int,
                 max_rows: int = ROW_BUCKETS[-1], capture: bool = True, decode_kernel: Any | None = None) -> None:
        """``decode_kernel``: the runner's decode attention kernel, replayed inside the graphs (None:
        torch over gathered K/V)."""
        self.model = model
        self.decode_kernel = decode_kernel
        self.kv_cache = kv_cache
        self.block_size = kv_cache.shape[3]
        self.capture = capture
        # Buckets up to the first that holds max_rows; a step with more rows runs eagerly.
        self.row_buckets = [r for r in ROW_BUCKETS if r < max_rows] + [r for r in ROW_BUCKETS if r >= max_rows][:1]
        # Powers of two from MIN_BLOCK_BUCKET, then the longest context itself.
        doublings = (MIN_BLOCK_BUCKET << i for i in itertools.count())
        self.block_buckets = [*itertools.takewhile(lambda b: b < max_blocks_per_seq, doublings), max_blocks_per_seq]
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.num_steps = 0              # steps run through a bucket (replayed, or eagerly without capture)

    def capture_all(self) -> None:
        """Record every bucket's graph now (on CUDA, before any other thread uses the device)."""
        for rows in self.row_buckets:
            for blocks in self.block_buckets:
                if (rows, blocks) not in self._graphs:
                    self._graphs[rows, blocks] = self._new_graph(rows, blocks)

    def bucket(self, num_rows: int, max_blocks: int) -> tuple[int, int] | None:
        """The smallest (rows, blocks) bucket that holds the step; None if none does."""
        rows = next((r for r in self.row_buckets if r >= num_rows), None)
        blocks = next((b for b in self.block_buckets if b >= max_blocks), None)
        return None if rows is None or blocks is None else (rows, blocks)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_rows: torch.Tensor,
                decode: DecodeBatch) -> torch.Tensor | None:
        """Hidden states [num_rows, hidden] of a decode-only step, or None when no bucket fits."""
        n, max_blocks = decode.block_tables.shape
        key = self.bucket(n, max_blocks)
        if key is None:
            return None
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = self._new_graph(*key)
        g.input_ids[:n].copy_(input_ids)
        g.positions[:n].copy_(positions)
        g.slot_rows[:n].copy_(slot_rows)
        g.block_tables[:n, :max_blocks].copy_(decode.block_tables)
        g.block_tables[:n, max_blocks:].zero_()
        g.context_lens[:n].copy_(decode.context_lens)
        if n < g.rows_used:
            self._pad(g, n)
        g.rows_used = n
        if g.graph is None:
            g.hidden = self._run(g)
        else:
            g.graph.replay()
        self.num_steps += 1
        assert g.hidden is not None
        return g.hidden[:n]

    def _pad(self, g: _Graph, first: int) -> None:
        """Rows ``first``.. back to padding (an earlier step's rows there would write their old slots)."""
        g.input_ids[first:].zero_()
        g.positions[first:].zero_()
        g.slot_rows[first:, 0] = 0
        g.slot_rows[first:, 1] = self.block_size
        g.block_tables[first:].zero_()
        g.context_lens[first:].fill_(1)

    def _new_graph(self, rows: int, blocks: int) -> _Graph:
        device = self.kv_cache.device
        padding_slot = torch.tensor([0, self.block_size], device=device)   # block 0: K row, V row
        g = _Graph(input_ids=torch.zeros(rows, dtype=torch.long, device=device),
                   positions=torch.zeros(rows, dtype=torch.long, device=device),
                   slot_rows=padding_slot.repeat(rows, 1),
                   block_tables=torch.zeros(rows, blocks, dtype=torch.long, device=device),
                   context_lens=torch.ones(rows, dtype=torch.long, device=device),
                   hidden=None, graph=None)
        if not self.capture:
            return g
        # Warm up on a side stream (lazy initialisation stays out of the graph), then record.
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            self._run(g)
        torch.cuda.current_stream(device).wait_stream(stream)
        g.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g.graph, pool=self._pool):
            g.hidden = self._run(g)
        return g

    def _run(self, g: _Graph) -> torch.Tensor:
        """The model over the bucket's static inputs (recorded when capturing)."""
        rows, blocks = g.block_tables.shape
        kernel, keys = self.decode_kernel, blocks * self.block_size
        if kernel is None:
            mask, workspace = decode_mask(g.context_lens, keys), None
        else:
            config = self.model.config
            mask, workspace = None, kernel.workspace(rows, keys, config.num_heads, config.head_dim)
        decode = DecodeBatch(num_seqs=rows, block_tables=g.block_tables, context_lens=g.context_lens,
                             mask=mask, kernel=kernel, workspace=workspace)
        attn = AttnMetadata(slot_rows=g.slot_rows, decode=decode, prefills=())
        return self.model(g.input_ids, g.positions, attn, self.kv_cache)
