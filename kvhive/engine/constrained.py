"""The runner's constrained rows: each structured request's grammar matcher, and the token masks
of a step's constrained sample rows.

A step's masks are computed off the critical path: ``start`` hands them to a worker thread before
the forward pass (llguidance fills them without the GIL, so they run while the model does), and
``mask_logits`` joins it before sampling. When the thread fails, or overlap is off (``EngineConfig.grammar_mask_overlap``
False; ``kvhive serve`` turns it off when ``KVHIVE_GRAMMAR_MASK_SYNC=1``),
the masks are computed right there instead, with the same result. Only the constrained rows' logits
change; the raw logits stay for logprobs.

The worker fills each row's bitmask itself, one matcher after the other (llguidance drops the GIL
for each): the library's executor would hand the batch to one more thread, a second wake-up on a
host whose cores the forward pass already uses, which cost more than the masks. It also unpacks
the bitmasks to one flag per token there, so the step thread only stores -inf through them (a
packed apply on the step thread, word by word, took less time in a warm loop but more in the
step, right after the forward pass, than one masked store).

A matcher is made from the spec's cached compiled grammar the first time its request samples, is
advanced by every token sampled for it (so it survives preemption and recompute: the runner sees
every token a request gets), and is dropped by ``release`` when the request ends.
"""

from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from kvhive.engine.request_errors import NO_TOKEN, grammar_failure
from kvhive.engine.step import ScheduledSeq
from kvhive.structured import GrammarCompiler, GrammarMatcher, StructuredOutputError

logger = logging.getLogger(__name__)


@dataclass
class MaskJob:
    """One step's constrained rows: ``rows`` index the step's sampled seqs, their requests and
    matchers beside them."""

    rows: list[int]
    request_ids: list[str]
    matchers: list[GrammarMatcher]
    future: Future | None = None


@dataclass
class MaskTimes:
    """Where the mask time went: computing (on the worker or inline) and waiting for the worker."""

    steps: int = 0
    rows: int = 0
    compute_seconds: float = 0.0        # filling and unpacking masks, wherever it ran
    wait_seconds: float = 0.0           # the step thread blocked on the worker (overlap's leftover)
    inline_seconds: float = 0.0         # masks computed on the step thread (overlap off or failed)
    apply_seconds: float = 0.0          # the step thread masking logits and advancing matchers


class GrammarRows:
    """Matchers of the running structured requests and the masks of their sample rows."""

    def __init__(self, compiler: GrammarCompiler, logits_width: int, overlap: bool = True) -> None:
        self.compiler = compiler
        self.logits_width = logits_width
        self.overlap = overlap
        self._matchers: dict[str, GrammarMatcher] = {}
        self._pool: ThreadPoolExecutor | None = None
        self.times = MaskTimes()

    def start(self, seqs: list[ScheduledSeq], failed: dict[str, str]) -> MaskJob | None:
        """The mask job of the structured seqs among the step's sampled ``seqs`` (None: none), started
        on the worker thread when overlapping; a spec that does not compile fails its request."""
        rows, ids, matchers = [], [], []
        for i, s in enumerate(seqs):
            if s.sampling.structured is None or s.request_id in failed:
                continue
            matcher = self.matcher_for(s, failed)
            if matcher is None:
                continue
            rows.append(i)
            ids.append(s.request_id)
            matchers.append(matcher)
        if not rows:
            return None
        job = MaskJob(rows, ids, matchers)
        if self.overlap:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvhive-grammar")
            job.future = self._pool.submit(self._masks, matchers)
        return job

    def matcher_for(self, seq: ScheduledSeq, failed: dict[str, str]) -> GrammarMatcher | None:
        """The structured seq's matcher, compiled at its first step; None (its request in
        ``failed``) when its spec does not compile."""
        matcher = self._matchers.get(seq.request_id)
        if matcher is None:
            try:
                matcher = self.compiler.compile(seq.sampling.structured).matcher()
            except StructuredOutputError as exc:
                failed[seq.request_id] = str(exc)
                return None
            self._matchers[seq.request_id] = matcher
        return matcher

    def draft_masks(self, matcher: GrammarMatcher, drafts: tuple[int, ...]) -> np.ndarray:
        """The blocked tokens [rows, logits width] of the rows a drafted seq is verified at: row j
        after drafts 0..j-1. Rows stop after the first draft the grammar refuses or that completes
        the output (that position is then the target model's own pick), so there are at most
        len(drafts) + 1. The matcher ends where it started."""
        rows, consumed = [], 0
        words = np.zeros(self.compiler.mask_words, dtype=np.int32)
        try:
            for j in range(len(drafts) + 1):
                # The matcher's own mask call, as the step's mask job fills its rows.
                matcher.fill_mask(words)
                rows.append(_unpacked_blocked(words, self.logits_width))
                if j == len(drafts) or rows[-1][drafts[j]] or not matcher.accept(drafts[j]):
                    break
                consumed += 1
                if matcher.is_complete:
                    break
        finally:
            matcher.rollback(consumed)
        return np.stack(rows)

    def mask_logits(self, job: MaskJob | None, logits: torch.Tensor, failed: dict[str, str]) -> torch.Tensor:
        """``logits`` [sampled rows, vocab] with each constrained row's disallowed tokens at -inf (a
        new tensor; ``logits`` unchanged). A row whose matcher is in error, or that allows no token
        of the model's vocabulary, fails its request."""
        if job is None:
            return logits
        blocked, empty = self._join(job)
        started = time.perf_counter()
        keep = []
        for j, m in enumerate(job.matchers):
            if m.error is not None:
                failed[job.request_ids[j]] = grammar_failure(m)
            elif empty[j]:
                failed[job.request_ids[j]] = NO_TOKEN
            else:
                keep.append(j)
        if keep:
            logits = _masked(logits, [job.rows[j] for j in keep], blocked[keep] if len(keep) < len(job.rows) else blocked)
        self.times.apply_seconds += time.perf_counter() - started
        return logits

    def advance(self, job: MaskJob | None, tokens: list[int | None], failed: dict[str, str]) -> set[str]:
        """Feed each constrained row's sampled token to its matcher; the ids whose output is now
        complete (``tokens``: one per sampled seq, None where none came). A token the grammar
        rejects fails its request."""
        done: set[str] = set()
        if job is None:
            return done
        started = time.perf_counter()
        for i, rid, m in zip(job.rows, job.request_ids, job.matchers, strict=True):
            token = tokens[i]
            if token is None or rid in failed:
                continue
            if not m.accept(token):
                failed[rid] = grammar_failure(m, token)
            elif m.is_complete:
                done.add(rid)
        self.times.apply_seconds += time.perf_counter() - started
        return done

    def wait(self, job: MaskJob | None) -> None:
        """Let a started job finish (a step that raised must not leave a worker using its matchers)."""
        if job is not None and job.future is not None:
            with contextlib.suppress(Exception):     # the step already failed; nothing reads this job
                job.future.result()

    def release(self, request_ids: list[str]) -> None:
        """Drop the matchers of requests that ended."""
        for rid in request_ids:
            self._matchers.pop(rid, None)

    def close(self) -> None:
        """Stop the worker thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # ------------------------------------------------------------ internals

    def _join(self, job: MaskJob) -> tuple[np.ndarray, np.ndarray]:
        """The job's blocked tokens [rows, logits width] and rows with none allowed [rows] (bool): the
        worker's, else computed here."""
        self.times.steps += 1
        self.times.rows += len(job.rows)
        if job.future is not None:
            waited = time.perf_counter()
            try:
                masks = job.future.result()
                self.times.wait_seconds += time.perf_counter() - waited
                return masks
            except Exception:  # noqa: BLE001 - computed again on this thread below
                logger.warning("grammar masks failed on the worker thread; computing them inline", exc_info=True)
        started = time.perf_counter()
        masks = self._masks(job.matchers)
        self.times.inline_seconds += time.perf_counter() - started
        return masks

    def _masks(self, matchers: list[GrammarMatcher]) -> tuple[np.ndarray, np.ndarray]:
        """True where a token is not allowed [len(matchers), logits width], and where a row allows
        none [len(matchers)]. Each row is filled on this thread (llguidance drops the GIL while it
        fills one); the empty rows are read off the packed words, 32 tokens at a time."""
        started = time.perf_counter()
        bitmask = np.zeros((len(matchers), self.compiler.mask_words), dtype=np.int32)
        for row, m in zip(bitmask, matchers, strict=True):
            m.fill_mask(row)
        empty = _empty_rows(bitmask, self.logits_width)
        blocked = _unpacked_blocked(bitmask, self.logits_width)
        self.times.compute_seconds += time.perf_counter() - started
        return blocked, empty


def _unpacked_blocked(bitmask: np.ndarray, width: int) -> np.ndarray:
    """True where a token of the first ``width`` is not allowed: packed masks [..., words] (int32)
    unpacked to [..., width]."""
    return np.unpackbits(bitmask.view(np.uint8), axis=-1, count=width, bitorder="little") == 0


def _empty_rows(bitmask: np.ndarray, width: int) -> np.ndarray:
    """Rows of ``bitmask`` [rows, words] that allow no token below ``width`` (bits past it, the
    tokenizer's ids beyond the logits, do not count)."""
    whole, tail = divmod(width, 32)
    empty = ~bitmask[:, :whole].any(axis=1)
    if tail:
        empty &= (bitmask[:, whole] & np.int32((1 << tail) - 1)) == 0
    return empty


def _masked(logits: torch.Tensor, rows: list[int], blocked: np.ndarray) -> torch.Tensor:
    """A copy of ``logits`` with ``blocked[j]``'s tokens of row ``rows[j]`` at -inf.

    float32 on the CPU goes through numpy, one thread: a few small torch ops over a 50k-wide row each
    wake torch's thread team, which costs milliseconds on a busy machine; a copy and a masked store
    in numpy take tens of microseconds.
    """
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        out = logits.numpy().copy()
        for j, row in enumerate(rows):
            np.putmask(out[row], blocked[j], -np.inf)
        return torch.from_numpy(out)
    idx = torch.tensor(rows, device=logits.device)
    masked = logits.index_select(0, idx).masked_fill_(torch.from_numpy(blocked).to(logits.device), float("-inf"))
    return logits.index_copy(0, idx, masked)
