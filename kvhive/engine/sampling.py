"""Token sampling from logits (greedy, temperature, top-k, top-p, per-request seeded generators),
and the logprobs of the sampled tokens for the rows that ask for them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvhive.engine.step import TokenLogprobs
from kvhive.request import SamplingParams

# Logits dtypes numpy reads in place; others (bfloat16) and non-CPU tensors take torch's argmax.
_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16)


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's argmax of ``logits`` [n, vocab] (the first of equal maxima, as torch gives it).
    On CPU numpy's vectorised argmax reads the tensor in place, several times faster than torch's
    over a vocabulary; a drafted step pays it once per verified row."""
    if logits.device.type == "cpu" and logits.dtype in _NUMPY_DTYPES and not logits.requires_grad:
        return logits.numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


def sample_tokens(logits: torch.Tensor, params: Sequence[SamplingParams],
                  generators: Sequence[torch.Generator | None], checked: torch.Tensor | None = None) -> list[int]:
    """Pick one token per row of float32 ``logits`` [n, vocab]; row i follows params[i].

    Greedy rows (``SamplingParams.greedy``) take the argmax. The others are sampled from the
    temperature-scaled distribution restricted to the top-k tokens and the top-p nucleus; a row
    with a generator draws from it (reproducible for a fixed seed), the others from torch's default.

    Raises ValueError, before any generator draws, when a row's logits hold NaN or +inf or are all
    -inf, or a random row's distribution is not finite: the caller can then sample the rows one at
    a time and fail only the bad ones, the good rows' generators untouched. ``checked``: the model's
    raw logits these were masked from (a grammar's -inf would send the check down its slow path):
    they are checked instead.
    """
    check_logits(logits if checked is None else checked)
    tokens = argmax_rows(logits)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not random_rows:
        return tokens
    rows = torch.tensor(random_rows, device=logits.device)
    probs = _filtered_probs(logits.index_select(0, rows), [params[i] for i in random_rows])
    bad = ~(torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0))
    if bool(bad.any()):
        row = random_rows[int(bad.nonzero()[0])]
        raise ValueError(f"row {row}: the sampling distribution is not finite")
    for j, i in enumerate(random_rows):
        # One draw per row: generators are per request and cannot be batched.
        tokens[i] = int(torch.multinomial(probs[j], 1, generator=generators[i]))
    return tokens


def check_logits(logits: torch.Tensor) -> None:
    """ValueError naming the first row of ``logits`` [n, vocab] that holds NaN or +inf, or only -inf."""
    if bool(torch.isfinite(logits.sum())):
        return      # one pass: every logit finite (a -inf mask or a sum past float range looks closer)
    bad = torch.isnan(logits).any(dim=-1) | torch.isposinf(logits).any(dim=-1) | torch.isneginf(logits).all(dim=-1)
    if bool(bad.any()):
        raise ValueError(f"row {int(bad.nonzero()[0])}: the logits hold NaN or inf")


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Softmax of logits / temperature with tokens outside top-k and top-p zeroed, per row."""
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], device=device, dtype=logits.dtype)
    logits = logits / temps.unsqueeze(1)
    vocab = logits.shape[-1]
    top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_ps = [p.top_p for p in params]
    if min(top_ks) == vocab and min(top_ps) == 1.0:
        return torch.softmax(logits, dim=-1)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=device).unsqueeze(0)
    # Top-k: keep ranks < k.
    drop = rank >= torch.tensor(top_ks, device=device).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    # Top-p: keep the smallest prefix whose mass reaches p; the top token always stays (a top_p
    # that rounds to 0 in float32 would otherwise drop every token).
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = mass_before >= torch.tensor(top_ps, device=device, dtype=logits.dtype).unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    filtered = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    return torch.softmax(filtered, dim=-1)


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int],
                   num_top: Sequence[int | None]) -> list[TokenLogprobs | None]:
    """Logprob of token_ids[i] and the num_top[i] most likely tokens, for each row of ``logits``.

    Rows whose num_top is None get None and cost nothing. Values are the log-softmax of the raw
    float32 logits, before temperature, top-k and top-p (what vLLM reports by default). The top
    tokens are ranked by the raw logits, so a greedy row's token is always its top-1 entry.
    """
    out: list[TokenLogprobs | None] = [None] * len(num_top)
    rows = [i for i, k in enumerate(num_top) if k is not None]
    if not rows:
        return out
    device = logits.device
    picked = logits.index_select(0, torch.tensor(rows, device=device)).float()
    logprobs = torch.log_softmax(picked, dim=-1)
    chosen = logprobs.gather(1, torch.tensor([[token_ids[i]] for i in rows], device=device))
    k = min(max(num_top[i] or 0 for i in rows), picked.shape[-1])
    top_ids = picked.topk(k, dim=-1).indices
    top_values = logprobs.gather(1, top_ids)
    chosen_list, ids, values = chosen.squeeze(1).tolist(), top_ids.tolist(), top_values.tolist()
    for j, i in enumerate(rows):
        n = num_top[i] or 0
        out[i] = TokenLogprobs(token_ids[i], chosen_list[j], tuple(zip(ids[j][:n], values[j][:n], strict=True)))
    return out
