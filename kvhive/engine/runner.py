"""ModelRunner: turns a StepPlan into tensors, runs the model over the paged KV pool, samples.

The runner owns the KV pool (``kv_cache``, layout in ``kvhive.model.attention``) and the per-request
sampling generators; it never imports the scheduler (they share only ``kvhive.engine.step``). A plan
becomes tensors in ``kvhive.engine.step_inputs``; ``kvhive.engine.attention_kernels`` picks which
attention implementation runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from kvhive.config import ModelConfig
from kvhive.connector.base import ConnectorWorker
from kvhive.core.host_resources import kv_memory_problem, usable_memory_bytes
from kvhive.engine.attention_kernels import choose_attention_kernels
from kvhive.engine.constrained import GrammarRows
from kvhive.engine.logits_processors import LogitsProcessors
from kvhive.engine.sampling import sample_tokens, token_logprobs
from kvhive.engine.speculative.draft_verification import (
    VerifiedDrafts,
    drafted_result,
    sample_row_layout,
    verify_drafts,
)
from kvhive.engine.step import ScheduledSeq, StepPlan, StepResult, TokenLogprobs
from kvhive.engine.step_inputs import PoolShape, StepInputBuilder, StepInputs, WindowPool
from kvhive.kv.window_group import WindowLayout
from kvhive.model import host_pages
from kvhive.model.cuda_graphs import DecodeGraphs
from kvhive.model.kv_quant import QUANTIZED_KV_DTYPES, canonical_kv_dtype, pool_dtype, row_elements
from kvhive.model.llama import LlamaModel, resolve_dtype
from kvhive.request import SEED_END
from kvhive.structured import GrammarCompiler

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Prompt logprobs take the logits of this many prompt rows at a time (x vocab x 4 bytes: 48 MiB
# for a 49,152-token vocabulary), reduced to the chosen token and the top ones before the next.
PROMPT_LOGPROBS_ROWS = 256


def _rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Rows ``rows`` of ``t`` (``t`` itself, no copy, when they are all of its rows in order)."""
    return t if rows == list(range(t.shape[0])) else t[rows]


def _quantized_kv(kv_dtype: str, dtype: torch.dtype) -> str | None:
    """The 8-bit format a runner's pool holds ("int8" or "fp8"), None for a float pool (in the model's
    ``dtype``: ValueError for another float KV dtype)."""
    kv = canonical_kv_dtype(kv_dtype)
    if kv in QUANTIZED_KV_DTYPES:
        return kv
    if kv != "auto" and resolve_dtype(kv) != dtype:
        raise ValueError(f"--kv-cache-dtype {kv_dtype}: a float KV pool holds the model's dtype ({dtype})")
    return None


class ModelRunner:
    """Executes StepPlans on one model and one KV pool."""

    def __init__(self, model: LlamaModel, model_config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: str | torch.dtype = "float32", device: torch.device | str = "cpu",
                 native_attention: bool = True, connector: ConnectorWorker | None = None,
                 cuda_graphs: bool = True, max_num_seqs: int = 32, isa: str | None = None,
                 window: WindowLayout | None = None, measure_attention: bool = False,
                 grammars: GrammarCompiler | None = None, grammar_mask_overlap: bool = True,
                 attention_backend: str = "auto", kv_dtype: str = "auto") -> None:
        """``isa``: the CPU ISA level of the attention kernels (``kvhive.model.cpu``; None: the CPU's best).
        ``window``: the window layers get a pool of their own (``kvhive.kv.window_group``); None: one pool.
        ``measure_attention``: a bf16 pool's prefill attention runs in torch instead of the C++ kernel
        where a synthetic layer says torch is faster here (else the kernel, whatever the timing).
        ``grammars``: compiles structured requests' specs (None: such a request fails); their token
        masks are computed while the forward runs unless ``grammar_mask_overlap`` is False.
        ``attention_backend``: auto, triton or torch (``kvhive.engine.attention_kernels``).
        ``kv_dtype``: the pool's --kv-cache-dtype (auto: the model's dtype; int8 or fp8: packed 8-bit
        rows, ``kvhive.model.kv_quant``)."""
        self.model = model
        self.config = model_config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = resolve_dtype(dtype)
        self.device = torch.device(device)
        if model.dtype != self.dtype:
            raise ValueError(f"the model holds {model.dtype} weights but the runner was asked for {self.dtype}")
        # The pool's 8-bit format ("int8" or "fp8"), None for a float pool in the model's dtype.
        self.kv_dtype = _quantized_kv(kv_dtype, self.dtype)
        self.window = window
        self._allocate_pools(connector)
        # Seeded requests keep their generator until they appear in finished_request_ids.
        self._generators: dict[str, torch.Generator] = {}
        # Penalties' token histories (kept until finished_request_ids), bias, min_p, min_tokens.
        self.logits_processors = LogitsProcessors(self.device)
        # Structured requests keep their grammar matcher as long (kvhive.engine.constrained).
        self.grammar_rows = None if grammars is None else GrammarRows(grammars, model_config.vocab_size,
                                                                      overlap=grammar_mask_overlap)
        # Attention straight from the pool on CPU (C++ kernels built for the ISA level ``isa``); None:
        # gather + torch (CUDA, no compiler, the portable level for prefill, or native_attention=False).
        kernels = choose_attention_kernels(model_config, self.dtype, self.device, native_attention, isa,
                                           measure_attention, backend=attention_backend, kv_dtype=self.kv_dtype)
        self.decode_kernel, self.prefill_kernel = kernels.decode, kernels.prefill
        self.inputs = StepInputBuilder(
            model_config, PoolShape(num_blocks, block_size, self.kv_cache.shape[1], self.device), kernels,
            None if window is None else WindowPool(self.window_cache, window), layer_hooks=connector,
            selects_output_rows=getattr(model, "selects_output_rows", False))
        # CUDA: decode-only steps replay per-bucket graphs (kvhive.model.cuda_graphs).
        self.decode_graphs: DecodeGraphs | None = None
        if cuda_graphs and self.device.type == "cuda" and getattr(model, "cuda_graphs", True):
            self._capture_decode_graphs(max_num_seqs)

    def _allocate_pools(self, connector: ConnectorWorker | None) -> None:
        """Allocate the KV pool (and the window layers' pool) and register them with the connector."""
        c, window = self.config, self.window
        num_layers = c.num_layers - (window.num_window_layers if window is not None else 0)
        # [num_blocks, num_layers, 2, block_size, num_kv_heads, row]; a block is contiguous. A row is
        # head_dim values, or an 8-bit pool's head_dim codes and 2-byte scale (kvhive.model.kv_quant).
        kv = self.kv_dtype
        row, dtype = (c.head_dim, self.dtype) if kv is None else (row_elements(c.head_dim, kv), pool_dtype(kv))
        if self.device.type == "cpu":   # a pool the machine cannot hold would end in the OOM killer
            block_layers = self.num_blocks * num_layers + (0 if window is None else
                                                           window.num_blocks * window.num_window_layers)
            pool_gib = block_layers * 2 * self.block_size * c.num_kv_heads * row * dtype.itemsize / 2**30
            problem = kv_memory_problem([(f"a KV pool of {self.num_blocks:,} blocks", pool_gib)],
                                        usable_memory_bytes())
            if problem is not None:
                raise ValueError(f"{problem}; lower --kv-cache-gb or --num-blocks")
        try:        # a pool the device cannot hold refuses the config (exit 2), not a traceback
            shape = (self.num_blocks, num_layers, 2, self.block_size, c.num_kv_heads, row)
            # The window layers' pool (kvhive.model.window_kv), in the same layout; None: one pool.
            window_shape = None if window is None else (window.num_blocks, window.num_window_layers, *shape[2:])
            # On the CPU on huge pages where the host gives them (kvhive.model.host_pages).
            self.kv_cache, self.pool_huge_pages = host_pages.zeros(shape, dtype, self.device)
            self.window_cache = (None if window_shape is None else
                                 host_pages.zeros(window_shape, dtype, self.device)[0])
        except (RuntimeError, MemoryError) as exc:          # torch.OutOfMemoryError is a RuntimeError
            raise ValueError(f"the KV pool of {self.num_blocks} blocks cannot be allocated on {self.device}; "
                             f"lower --kv-cache-gb or --num-blocks ({str(exc).splitlines()[0][:200]})") from exc
        # The KV connector's worker half: moves blocks between the pool and the store tiers.
        self.connector = connector
        if connector is not None:
            connector.register_kv_caches(self.kv_cache)
            if self.window_cache is not None:
                connector.register_window_cache(self.window_cache, window.window_layers)

    def _capture_decode_graphs(self, max_num_seqs: int) -> None:
        """Capture the CUDA graphs decode-only steps replay, one per (rows, blocks) bucket."""
        max_blocks = -(-self.config.max_position_embeddings // self.block_size)
        self.decode_graphs = DecodeGraphs(self.model, self.kv_cache, max_blocks, max_rows=max_num_seqs,
                                          decode_kernel=self.decode_kernel)
        started = time.perf_counter()
        self.decode_graphs.capture_all()
        logger.info("captured %d CUDA graphs for decode steps in %.1f s",
                    len(self.decode_graphs.row_buckets) * len(self.decode_graphs.block_buckets),
                    time.perf_counter() - started)

    def paths(self) -> dict[str, str]:
        """Which implementation decode and prefill attention run here (for the startup log and /version)."""
        sdpa = f"torch SDPA on {self.device}" if self.device.type != "cpu" else "torch SDPA on gathered K/V"
        window = {} if self.window is None else {"window_kv": self.window.describe(self.num_blocks)}
        if self.kv_dtype is not None:
            sdpa += f" (dequantised from {self.kv_dtype})"
        pool = {"kv_pool": host_pages.describe(self.pool_huge_pages)} if self.device.type == "cpu" else {}
        return {"decode_attention": self._kernel_name(self.decode_kernel, sdpa),
                "prefill_attention": self._kernel_name(self.prefill_kernel, sdpa), **window, **pool}

    def _kernel_name(self, kernel: Any | None, fallback: str) -> str:
        """A kernel's path name (its ``describe``); ``fallback`` without one."""
        return fallback if kernel is None else kernel.describe(self.device)

    def pool_bytes(self) -> int:
        """Bytes of the KV pool (both pools when the window layers have their own)."""
        return self.kv_cache.nbytes + (0 if self.window_cache is None else self.window_cache.nbytes)

    @staticmethod
    def kv_bytes_per_block(model_config: ModelConfig, block_size: int, dtype: str | torch.dtype,
                           kv_dtype: str = "auto") -> int:
        """Bytes one pool block takes (K and V rows of block_size tokens in every layer; ``kv_dtype``:
        the pool's --kv-cache-dtype, auto: the model's ``dtype``)."""
        c, kv = model_config, _quantized_kv(kv_dtype, resolve_dtype(dtype))
        rows = c.kv_values_per_token // c.head_dim * block_size
        if kv is not None:
            return rows * row_elements(c.head_dim, kv)          # one byte an element
        return rows * c.head_dim * torch.empty((), dtype=resolve_dtype(dtype)).element_size()

    @staticmethod
    def num_blocks_for_bytes(model_config: ModelConfig, block_size: int, dtype: str | torch.dtype,
                             nbytes: int, kv_dtype: str = "auto") -> int:
        """How many pool blocks fit in nbytes."""
        return int(nbytes) // ModelRunner.kv_bytes_per_block(model_config, block_size, dtype, kv_dtype)

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step: start its KV transfers, compute every scheduled token, sample where asked."""
        self.release(plan.finished_request_ids)
        if self.connector is not None and plan.connector_meta is not None:
            # Saves are snapshotted here, before this step's forward can overwrite a reused block.
            self.connector.start_load_kv(plan.connector_meta)
        for src, dst, n in plan.block_copies:           # rows as they are: bytes for an 8-bit pool
            self.kv_cache[dst, :, :, :n] = self.kv_cache[src, :, :, :n]
        if plan.is_empty:
            return StepResult(sampled={})
        inputs = self.prepare_inputs(plan)
        failed: dict[str, str] = {}
        # Seqs with drafts are verified apart (kvhive.engine.speculative.draft_verification).
        sampled_seqs = [s for s in inputs.seqs if s.sample and not s.draft_token_ids]
        # Constrained rows' token masks start now, on a worker thread, and run with the forward.
        job = self._start_masks(sampled_seqs, failed)
        try:
            return self._run(plan, inputs, sampled_seqs, job, failed)
        finally:
            if self.grammar_rows is not None:
                self.grammar_rows.wait(job)

    def _run(self, plan: StepPlan, inputs: StepInputs, sampled_seqs: list[ScheduledSeq], job,
             failed: dict[str, str]) -> StepResult:
        """The forward pass, sampling and logprobs of a prepared step (``job``: its mask job)."""
        with torch.inference_mode():
            hidden = self._graphed_decode(plan, inputs)
            selected = False            # hidden holds the sampled rows alone
            if hidden is None:
                hidden = self.model(inputs.input_ids, inputs.positions, inputs.attn, self.kv_cache)
                selected = inputs.attn.out_rows is not None
            prompt = self._prompt_logprobs(hidden, inputs.seqs, failed) if inputs.has_prompt_logprobs else {}
            if not inputs.sample_rows:
                return StepResult(sampled={}, prompt_logprobs=prompt, failed=failed)
            if not selected:
                hidden = hidden.index_select(0, torch.tensor(inputs.sample_rows, device=self.device))
            drafts = 0 if inputs.attn.plain_rows is None else len(inputs.input_ids) - inputs.attn.plain_rows
            logits = self.model.compute_logits(hidden, plain_rows=len(inputs.sample_rows) - drafts if drafts else None)
            logits, verified = self._verify_drafts(logits, inputs.seqs, failed)
            if not sampled_seqs:
                return drafted_result(StepResult(sampled={}, prompt_logprobs=prompt, failed=failed), verified)
            # Sampling reads the masked logits; logprobs report the raw ones.
            masked = logits if job is None else self.grammar_rows.mask_logits(job, logits, failed)
            if job is None:
                tokens = self._by_row(sampled_seqs, failed, "sampling", lambda rows: self.sample_rows(
                    _rows(logits, rows), [sampled_seqs[i] for i in rows]))
            else:
                tokens = self._by_row(sampled_seqs, failed, "sampling", lambda rows: self.sample_rows(
                    _rows(masked, rows), [sampled_seqs[i] for i in rows], raw=_rows(logits, rows)))
            completed = set() if job is None else self.grammar_rows.advance(job, tokens, failed)
            # Rows (of logits, and indices of sampled_seqs) whose seq got a token and asks for logprobs;
            # none in the common case: no log-softmax at all.
            asked = [i for i, s in enumerate(sampled_seqs)
                     if s.sampling.logprobs is not None and tokens[i] is not None and s.request_id not in failed]
            logprobs = self._by_row([sampled_seqs[i] for i in asked], failed, "logprobs", lambda rows: token_logprobs(
                _rows(logits, [asked[j] for j in rows]), [tokens[asked[j]] for j in rows],
                [sampled_seqs[asked[j]].sampling.logprobs for j in rows])) if asked else []
        # A request in ``failed`` gets no token, even one sampled before its logprobs failed.
        sampled = {s.request_id: t for s, t in zip(sampled_seqs, tokens, strict=True)
                   if t is not None and s.request_id not in failed}
        values = {sampled_seqs[i].request_id: lp for i, lp in zip(asked, logprobs, strict=True)
                  if lp is not None and sampled_seqs[i].request_id in sampled}
        return drafted_result(StepResult(sampled=sampled, logprobs=values, prompt_logprobs=prompt, failed=failed,
                                         completed=frozenset(completed & sampled.keys())), verified)

    def _verify_drafts(self, logits: torch.Tensor, seqs: list[ScheduledSeq], failed: dict[str, str]
                       ) -> tuple[torch.Tensor, dict[str, VerifiedDrafts]]:
        """The sampled rows' logits split: the plain seqs' rows (in order), and the verdict on each
        seq with drafts (a seq whose verification raises goes to ``failed``)."""
        layout = sample_row_layout([s for s in seqs if s.sample])
        if not layout.drafted:
            return logits, {}
        verified: dict[str, VerifiedDrafts] = {}
        for seq, row in layout.drafted:
            try:
                verified[seq.request_id] = verify_drafts(logits[row:row + 1 + len(seq.draft_token_ids)], seq,
                                                         self.logits_processors, self._generator(seq),
                                                         self.grammar_rows)
            except Exception as exc:  # noqa: BLE001 - fails this request only
                logger.exception("verifying drafts failed for request %s", seq.request_id)
                failed[seq.request_id] = f"verifying drafts failed: {type(exc).__name__}: {exc}"
        return _rows(logits, layout.plain_rows), verified

    def _start_masks(self, sampled_seqs: list[ScheduledSeq], failed: dict[str, str]):
        """The mask job of the step's structured sample rows (None: none); a structured request
        on a runner without a grammar compiler fails."""
        if self.grammar_rows is not None:
            return self.grammar_rows.start(sampled_seqs, failed)
        for s in sampled_seqs:
            if s.sampling.structured is not None:
                failed[s.request_id] = "this engine has no grammar compiler for structured outputs"
        return None

    def sample_rows(self, logits: torch.Tensor, seqs: list[ScheduledSeq], raw: torch.Tensor | None = None) -> list[int]:
        """One token per row of ``logits``, row i by seqs[i]'s sampling params and generator (the
        unit a step retries row by row when a batch raises), after the request's logits processors
        (penalties, bias, min_p, min_tokens); ``raw``: the unmasked logits, checked for NaN and inf in
        their place."""
        logits = self.logits_processors.apply(logits, seqs)
        return sample_tokens(logits, [s.sampling for s in seqs], [self._generator(s) for s in seqs], checked=raw)

    @staticmethod
    def _by_row(seqs: list[ScheduledSeq], failed: dict[str, str], what: str,
                compute: Callable[[list[int]], list[T]]) -> list[T | None]:
        """``compute(rows)`` for all of seqs' rows at once; if that raises, for each row alone, and
        a row that raises alone fails its request (in ``failed``, its entry None): one request's
        bad row never fails the others."""
        try:
            return list(compute(list(range(len(seqs)))))
        except Exception:  # noqa: BLE001 - retried row by row below
            if len(seqs) > 1:
                logger.warning("%s failed for a batch of %d rows; retrying row by row", what, len(seqs),
                               exc_info=True)
        out: list[T | None] = []
        for i, seq in enumerate(seqs):
            try:
                out.append(compute([i])[0])
            except Exception as exc:  # noqa: BLE001 - fails this request only
                logger.exception("%s failed for request %s", what, seq.request_id)
                failed.setdefault(seq.request_id, f"{what} failed: {type(exc).__name__}: {exc}")
                out.append(None)
        return out

    def _prompt_logprobs(self, hidden: torch.Tensor, seqs: list[ScheduledSeq], failed: dict[str, str]
                         ) -> dict[str, tuple[TokenLogprobs, ...]]:
        """The logprobs of the prompt rows each seq's ``PromptLogprobsSpan`` names; a seq whose rows
        raise goes to ``failed`` instead.

        Logits are computed PROMPT_LOGPROBS_ROWS rows at a time and reduced to the chosen token's
        logprob and the top alternatives at once: a whole chunk's [rows, vocab] never exists.
        """
        out: dict[str, tuple[TokenLogprobs, ...]] = {}
        offset = 0                          # flat row of the seq's first token
        for s in seqs:
            span = s.prompt_logprobs
            if span is not None:
                first = offset + span.first_pos - s.start_pos
                values: list[TokenLogprobs] = []
                try:
                    for lo in range(0, len(span.next_token_ids), PROMPT_LOGPROBS_ROWS):
                        targets = span.next_token_ids[lo:lo + PROMPT_LOGPROBS_ROWS]
                        logits = self.model.compute_logits(hidden[first + lo:first + lo + len(targets)])
                        values += token_logprobs(logits, targets, [span.num_top] * len(targets))
                    out[s.request_id] = tuple(values)
                except Exception as exc:  # noqa: BLE001 - fails this request only
                    logger.exception("prompt logprobs failed for request %s", s.request_id)
                    failed[s.request_id] = f"prompt logprobs failed: {type(exc).__name__}: {exc}"
            offset += s.num_new_tokens
        return out

    def _graphed_decode(self, plan: StepPlan, inputs: StepInputs) -> torch.Tensor | None:
        """Hidden states of a decode-only step through a CUDA graph; None when the step needs the
        eager forward (prefill chunks, a layer-by-layer KV load, no bucket, or no graphs)."""
        attn, meta = inputs.attn, plan.connector_meta
        if self.decode_graphs is None or attn.decode is None or attn.prefills:
            return None
        if meta is not None and (meta.kv_sends or any(not spec.is_async for spec in meta.loads)):
            return None                 # the layer hooks must run
        return self.decode_graphs.forward(inputs.input_ids, inputs.positions, attn.slot_rows, attn.decode)

    def release(self, request_ids: list[str]) -> None:
        """Forget the per-request state (seeded generators, token histories, grammar matchers) of
        finished requests."""
        self.logits_processors.release(request_ids)
        for request_id in request_ids:
            self._generators.pop(request_id, None)
        if self.grammar_rows is not None:
            self.grammar_rows.release(request_ids)

    def close(self) -> None:
        """Stop the grammar masks' worker thread."""
        if self.grammar_rows is not None:
            self.grammar_rows.close()

    def _generator(self, seq: ScheduledSeq) -> torch.Generator | None:
        """The request's own generator when it asked for a seed and sampling is random."""
        if seq.sampling.seed is None or seq.sampling.greedy:
            return None
        gen = self._generators.get(seq.request_id)
        if gen is None:
            # Seeds are in [-2**63, 2**64) (SamplingParams); as unsigned 64-bit, what manual_seed takes.
            gen = torch.Generator(device=self.device).manual_seed(seq.sampling.seed % SEED_END)
            self._generators[seq.request_id] = gen
        return gen

    def prepare_inputs(self, plan: StepPlan, all_rows: bool = False) -> StepInputs:
        """The step's tensors (``StepInputBuilder.build``); ``all_rows`` keeps every row's hidden state."""
        return self.inputs.build(plan, all_rows)
