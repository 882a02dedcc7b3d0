"""vLLM's sampling extras applied to the logits before sampling, and the token history they need.

In vLLM's order: ``logit_bias`` is added, the tokens ``min_tokens`` suppresses (a chunk's
``suppress_token_ids``) go to -inf, then the penalties: ``repetition_penalty`` over every token of
the prompt and the output (a positive logit divided by it, a negative one multiplied),
``frequency_penalty`` times each token's count in the output and ``presence_penalty`` once per
token in the output are subtracted (OpenAI's definition); last ``min_p`` drops the tokens whose
probability at the row's temperature is below ``min_p`` times the top one's (random rows only:
greedy ones keep their argmax anyway).

A request's history is handed over once (``ScheduledSeq.history``) and kept here, on the device,
as a per-token count of the output and a mask of the prompt, until the request finishes: a step
adds only the token sampled last. Rows whose sampling params change nothing cost nothing; a
batch's rows are processed together, each kind of extra in one vectorised pass over its rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import torch

from kvhive.engine.step import ScheduledSeq, TokenHistory


@dataclass
class _History:
    """One request's tokens as its penalties read them: how many positions were added, which
    tokens the prompt holds and how often each was generated (both [vocab], on the device)."""

    num_tokens: int
    in_prompt: torch.Tensor          # bool
    output_counts: torch.Tensor      # int32


class LogitsProcessors:
    """The per-request token histories and the transform of a step's logits (one instance per runner)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._histories: dict[str, _History] = {}

    def apply(self, logits: torch.Tensor, seqs: Sequence[ScheduledSeq]) -> torch.Tensor:
        """``logits`` [n, vocab] (row i of seqs[i]) after each row's extras: the same tensor when no
        row has any, else a processed copy (the raw logits stay as they are, for logprobs).
        Raises ValueError for a token id outside the vocabulary or a history that skips positions."""
        for s in seqs:
            if s.history is not None:
                self._add_history(s.request_id, s.history, logits.shape[-1])
        if not any(s.sampling.changes_logits or s.suppress_token_ids for s in seqs):
            return logits
        out = logits.clone()
        _add_bias(out, [s.sampling.logit_bias for s in seqs])
        _suppress(out, [s.suppress_token_ids for s in seqs])
        penalized = [i for i, s in enumerate(seqs) if s.sampling.uses_token_history]
        if penalized:
            self._penalize(out, penalized, seqs)
        filtered = [i for i, s in enumerate(seqs) if s.sampling.min_p > 0 and not s.sampling.greedy]
        if filtered:
            _min_p(out, filtered, [seqs[i].sampling.min_p for i in filtered],
                   [seqs[i].sampling.temperature for i in filtered])
        return out

    def apply_drafted(self, logits: torch.Tensor, seq: ScheduledSeq) -> torch.Tensor:
        """``logits`` [1 + m, vocab] of a seq with m drafts after its extras, row j processed as a
        plain step would be after drafts 0..j-1 were emitted: they count in the output the penalties
        read, and ``min_tokens`` suppresses EOS and stop tokens at the rows still short of it."""
        drafts = seq.draft_token_ids
        if seq.history is not None:
            self._add_history(seq.request_id, seq.history, logits.shape[-1])
        suppress_varies = seq.suppress_token_ids and seq.num_output_tokens + len(drafts) >= seq.sampling.min_tokens
        if not seq.sampling.uses_token_history and not suppress_varies:
            return self.apply(logits, [replace(seq, history=None)] * logits.shape[0])
        held = self._histories.get(seq.request_id) if seq.sampling.uses_token_history else None
        rows, added = [], []
        try:
            for j in range(logits.shape[0]):
                if j and held is not None:
                    held.output_counts[drafts[j - 1]] += 1        # taken back below
                    added.append(drafts[j - 1])
                suppress = seq.suppress_token_ids if seq.num_output_tokens + j < seq.sampling.min_tokens else ()
                rows.append(self.apply(logits[j:j + 1], [replace(seq, history=None, suppress_token_ids=suppress)]))
        finally:
            if added:
                ids = torch.tensor(added, device=self.device)
                held.output_counts.index_add_(0, ids, -torch.ones_like(ids, dtype=torch.int32))
        return torch.cat(rows)

    def release(self, request_ids: Iterable[str]) -> None:
        """Forget the histories of finished requests."""
        for request_id in request_ids:
            self._histories.pop(request_id, None)

    def num_histories(self) -> int:
        """How many requests' histories are held (for tests and stats)."""
        return len(self._histories)

    def _add_history(self, request_id: str, history: TokenHistory, vocab: int) -> None:
        """Add the positions of ``history`` not added yet (a row retried alone adds nothing twice)."""
        held = self._histories.get(request_id)
        if held is None:
            held = self._histories[request_id] = _History(
                0, torch.zeros(vocab, dtype=torch.bool, device=self.device),
                torch.zeros(vocab, dtype=torch.int32, device=self.device))
        if history.start > held.num_tokens:
            raise ValueError(f"request {request_id}: token history jumps from position {held.num_tokens} "
                             f"to {history.start}")
        skip = held.num_tokens - history.start
        new = history.token_ids[skip:]
        if not new:
            return
        if min(new) < 0 or max(new) >= vocab:
            raise ValueError(f"request {request_id}: a token id of its history is outside the vocabulary")
        num_prompt = max(0, min(len(new), history.num_prompt_tokens - held.num_tokens))
        if num_prompt:
            held.in_prompt[torch.tensor(new[:num_prompt], device=self.device)] = True
        if len(new) > num_prompt:
            ids = torch.tensor(new[num_prompt:], device=self.device)
            held.output_counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        held.num_tokens += len(new)

    def _penalize(self, out: torch.Tensor, rows: list[int], seqs: Sequence[ScheduledSeq]) -> None:
        """Repetition, frequency and presence penalties on ``rows`` of ``out``, in place."""
        histories = []
        for i in rows:
            held = self._histories.get(seqs[i].request_id)
            if held is None:
                raise ValueError(f"request {seqs[i].request_id}: a penalty without a token history")
            histories.append(held)
        index = torch.tensor(rows, device=out.device)
        logits = out.index_select(0, index)
        counts = torch.stack([h.output_counts for h in histories]).to(logits.dtype)
        in_output = counts > 0
        seen = torch.stack([h.in_prompt for h in histories]) | in_output

        def column(name: str) -> torch.Tensor:
            return torch.tensor([getattr(seqs[i].sampling, name) for i in rows], device=out.device,
                                dtype=logits.dtype).unsqueeze(1)

        repetition = column("repetition_penalty")
        penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, penalized, logits)
        logits = logits - column("frequency_penalty") * counts - column("presence_penalty") * in_output
        out.index_copy_(0, index, logits)


def _add_bias(out: torch.Tensor, biases: Sequence[tuple[tuple[int, float], ...]]) -> None:
    """Add each row's ``logit_bias`` to ``out`` in place (one scatter for the whole batch)."""
    rows = [i for i, bias in enumerate(biases) for _ in bias]
    if not rows:
        return
    ids = [token for bias in biases for token, _ in bias]
    _check_ids(ids, out.shape[-1], "logit_bias")
    values = torch.tensor([value for bias in biases for _, value in bias], dtype=out.dtype, device=out.device)
    out.index_put_((torch.tensor(rows, device=out.device), torch.tensor(ids, device=out.device)), values,
                   accumulate=True)


def _suppress(out: torch.Tensor, suppressed: Sequence[tuple[int, ...]]) -> None:
    """Set each row's suppressed tokens to -inf in ``out`` in place."""
    rows = [i for i, ids in enumerate(suppressed) for _ in ids]
    if not rows:
        return
    ids = [token for row in suppressed for token in row]
    _check_ids(ids, out.shape[-1], "a suppressed token")
    out[torch.tensor(rows, device=out.device), torch.tensor(ids, device=out.device)] = float("-inf")


def _min_p(out: torch.Tensor, rows: list[int], min_ps: list[float], temperatures: list[float]) -> None:
    """Drop (-inf) the tokens of ``rows`` whose probability at the row's temperature is below its
    ``min_p`` times the top token's, in place."""
    index = torch.tensor(rows, device=out.device)
    logits = out.index_select(0, index)
    temps = torch.tensor(temperatures, dtype=logits.dtype, device=out.device).unsqueeze(1)
    probs = torch.softmax(logits / temps, dim=-1)
    threshold = torch.tensor(min_ps, dtype=logits.dtype, device=out.device).unsqueeze(1)
    drop = probs < threshold * probs.max(dim=-1, keepdim=True).values
    out.index_copy_(0, index, logits.masked_fill(drop, float("-inf")))


def _check_ids(ids: list[int], vocab: int, what: str) -> None:
    """ValueError for an id outside [0, vocab)."""
    if min(ids) < 0 or max(ids) >= vocab:
        raise ValueError(f"{what} names a token id outside the vocabulary [0, {vocab})")

