"""Step inputs: a ``StepPlan`` flattened into the tensors one forward pass runs on.

Decode rows come first (one row per new token, each seeing the keys up to its own position), then
prefill chunks as contiguous spans. Each token gets its slot's (K row, V row) in the pool, laid out
as ``kvhive.model.attention`` describes; a window pool adds its own metadata (``kvhive.model.window_kv``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from kvhive.config import ModelConfig
from kvhive.connector.base import ConnectorWorker
from kvhive.engine.attention_kernels import AttentionKernels
from kvhive.engine.step import ScheduledSeq, StepPlan
from kvhive.kv.window_group import WindowLayout
from kvhive.model.attention import AttnMetadata, DecodeBatch, PrefillSpan, decode_mask, output_rows
from kvhive.model.window_kv import window_kv

# A chunk of at most this many new tokens over a cached prefix attends as decode rows, one per token
# (each sees the keys up to its own position), through the decode kernel, which reads the pool as it
# is: the prefill kernel would pack the whole prefix's K/V, every layer, for a handful of queries
# (a re-sent prompt whose last partial block is recomputed, a short follow-up turn).
DECODE_ROWS_MAX = 8


@dataclass(frozen=True)
class StepInputs:
    """The tensors of one step, with decode sequences first, then prefill chunks."""

    input_ids: torch.Tensor             # [T]
    positions: torch.Tensor             # [T]
    attn: AttnMetadata
    seqs: list[ScheduledSeq]            # in flat-batch order
    # Flat rows each seq with sample=True is sampled at, in order: its last token's; a seq with
    # drafts: its last known token's and every draft's (1 + len(draft_token_ids) rows).
    sample_rows: list[int]
    has_prompt_logprobs: bool = False   # some seq carries a PromptLogprobsSpan


@dataclass(frozen=True)
class PoolShape:
    """Where a pool's blocks live: how many, tokens per block, layers per block, on which device."""

    num_blocks: int
    block_size: int
    num_layers: int
    device: torch.device

    @property
    def rows_per_block(self) -> int:
        """Rows of ``kv_cache.view(-1, kv_heads * head_dim)`` per block (K of layer 0 at offset 0)."""
        return self.num_layers * 2 * self.block_size


@dataclass(frozen=True)
class WindowPool:
    """The window layers' own pool (``kvhive.model.window_kv``) and its layout."""

    cache: torch.Tensor
    layout: WindowLayout


def sample_rows_of(seqs: list[ScheduledSeq]) -> list[int]:
    """The batch rows each sampled seq is sampled at (seqs in batch order): its last token's, and
    for a seq with drafts the rows of its last known token and of each draft."""
    rows: list[int] = []
    end = 0
    for s in seqs:
        end += s.num_new_tokens
        if s.sample:
            rows.extend(range(end - 1 - len(s.draft_token_ids), end))
    return rows


class StepInputBuilder:
    """Flattens StepPlans into ``StepInputs`` for one model's pool."""

    def __init__(self, config: ModelConfig, pool: PoolShape, kernels: AttentionKernels,
                 window: WindowPool | None = None, layer_hooks: ConnectorWorker | None = None,
                 selects_output_rows: bool = False) -> None:
        """``layer_hooks``: the KV connector run around each layer; ``selects_output_rows``: the
        model can return the sampled rows' hidden states alone (``AttnMetadata.out_rows``)."""
        self.config = config
        self.pool = pool
        self.kernels = kernels
        self.window = window
        self.layer_hooks = layer_hooks
        self.selects_output_rows = selects_output_rows
        # New tokens a chunk over a cached prefix may have and still run as decode rows.
        self.decode_rows_max = DECODE_ROWS_MAX if kernels.decode is not None else 1

    def build(self, plan: StepPlan, all_rows: bool = False) -> StepInputs:
        """Flatten the plan into ids, positions, slot rows and attention metadata (decode first).
        The model then returns the hidden states of the sampled rows alone where that is fewer than
        all (``AttnMetadata.out_rows``); ``all_rows`` keeps every row's."""
        B, rpb, device = self.pool.block_size, self.pool.rows_per_block, self.pool.device
        decodes, prefills = self._decode_and_prefill(plan)
        ids: list[int] = []
        positions: list[np.ndarray] = []
        rows: list[np.ndarray] = []
        # Decode rows: one token (or a short chunk over a cached prefix) per sequence from start_pos on.
        for s in decodes:
            pos = range(s.start_pos, s.context_len)
            ids.extend(s.token_ids)
            positions.append(np.array(pos))
            rows.append(np.array([s.block_table[p // B] * rpb + p % B for p in pos]))
        decode = self._decode_batch(decodes) if decodes else None
        # Prefill chunks: contiguous spans after the decode rows.
        spans = []
        for s in prefills:
            pos, table = np.arange(s.start_pos, s.start_pos + s.num_new_tokens), np.asarray(s.block_table, dtype=np.int64)
            spans.append(self._prefill_span(s, len(ids), pos, table))
            ids.extend(s.token_ids)
            positions.append(pos)
            rows.append(table[pos // B] * rpb + pos % B)
        seqs = decodes + prefills
        drafts = sum(len(s.draft_token_ids) for s in seqs)
        attn = AttnMetadata(slot_rows=self._slot_rows(rows), decode=decode, prefills=tuple(spans),
                            prefill_kernel=self.kernels.prefill, layer_hooks=self.layer_hooks,
                            plain_rows=len(ids) - drafts if drafts else None)
        if self.window is not None:
            attn = replace(attn, window=window_kv(attn, decodes, prefills, self.window.cache, self.window.layout.window))
        sample_rows = sample_rows_of(seqs)
        has_prompt_logprobs = any(s.prompt_logprobs is not None for s in seqs)
        if not all_rows and self.selects_output_rows and not has_prompt_logprobs and len(sample_rows) < len(ids):
            # Rows nobody samples need only the last layer's K/V: the model skips the rest for them.
            attn = replace(attn, out_rows=output_rows(attn, sample_rows, device))
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.long, device=device),
            positions=torch.from_numpy(np.concatenate(positions)).to(device),
            attn=attn,
            seqs=seqs,
            sample_rows=sample_rows,
            has_prompt_logprobs=has_prompt_logprobs,
        )

    def _decode_and_prefill(self, plan: StepPlan) -> tuple[list[ScheduledSeq], list[ScheduledSeq]]:
        """The plan's seqs that run as decode rows and those that run as prefill spans; ValueError
        for a seq with nothing to compute or a block table too short for its context."""
        decodes: list[ScheduledSeq] = []
        prefills: list[ScheduledSeq] = []
        for s in plan.seqs:
            if s.num_new_tokens == 0:
                raise ValueError(f"request {s.request_id}: nothing to compute")
            if len(s.block_table) * self.pool.block_size < s.context_len:
                raise ValueError(f"request {s.request_id}: {len(s.block_table)} blocks cannot hold "
                                 f"{s.context_len} tokens")
            # A drafted step's rows run as decode rows whatever their number, where a decode kernel
            # exists: each row then gets the logits a plain step at its position gets (the prefill
            # kernel's sums differ in the last bits, enough to flip a near-tie in bfloat16).
            drafted = bool(s.draft_token_ids) and self.kernels.decode is not None
            as_rows = s.num_new_tokens == 1 or drafted or (s.start_pos > 0 and s.num_new_tokens <= self.decode_rows_max)
            (decodes if as_rows else prefills).append(s)
        return decodes, prefills

    def _decode_batch(self, decodes: list[ScheduledSeq]) -> DecodeBatch:
        """Padded block tables and context lengths of the decode rows (and what their path needs):
        one row per new token of each sequence, seeing the keys up to its own position."""
        B, c, device = self.pool.block_size, self.config, self.pool.device
        max_blocks = max((s.context_len + B - 1) // B for s in decodes)
        num_rows = sum(s.num_new_tokens for s in decodes)
        tables = np.zeros((num_rows, max_blocks), dtype=np.int64)
        ctx = np.empty(num_rows, dtype=np.int64)
        j = 0
        for s in decodes:
            for length in range(s.start_pos + 1, s.context_len + 1):
                n = (length + B - 1) // B
                tables[j, :n] = s.block_table[:n]   # padding points at block 0, never read unmasked
                ctx[j] = length
                j += 1
        context_lens = torch.from_numpy(ctx).to(device)
        mask = workspace = None
        if self.kernels.decode is not None:
            workspace = self.kernels.decode.workspace(num_rows, max_blocks * B, c.num_heads, c.head_dim)
        else:
            mask = decode_mask(context_lens, max_blocks * B)
        return DecodeBatch(num_seqs=num_rows, block_tables=torch.from_numpy(tables).to(device),
                           context_lens=context_lens, mask=mask, kernel=self.kernels.decode, workspace=workspace)

    def _prefill_span(self, s: ScheduledSeq, offset: int, pos: np.ndarray, table: np.ndarray) -> PrefillSpan:
        """The attention span of a prefill chunk whose tokens start at row ``offset`` of the batch."""
        B, device = self.pool.block_size, self.pool.device
        block_ids = mask = None
        if s.start_pos > 0 or self.kernels.prefill is not None:
            n_blocks = (s.context_len + B - 1) // B
            block_ids = torch.from_numpy(table[:n_blocks]).to(device)
        if s.start_pos > 0 and self.kernels.prefill is None and device.type == "cpu":
            # (CUDA needs no mask tensor: its SDPA takes the lower-right causal bias.)
            keep = np.arange(s.context_len)[None, :] <= pos[:, None]
            mask = torch.from_numpy(keep).to(device)
        return PrefillSpan(offset, offset + s.num_new_tokens, s.start_pos, block_ids, mask)

    def _slot_rows(self, rows: list[np.ndarray]) -> torch.Tensor:
        """The (K row, V row) pair of each token's slot in the pool; ValueError for a row outside it."""
        base = np.concatenate(rows)
        if base.size and (base.min() < 0 or base.max() >= self.pool.num_blocks * self.pool.rows_per_block):
            raise ValueError("a block table points outside the KV pool")     # the C++ kernels read unchecked
        slot_rows = np.stack([base, base + self.pool.block_size], axis=1)    # V follows K in a block
        return torch.from_numpy(slot_rows).to(self.pool.device)
