"""What a chunk carries for the runner's logits processing (``kvhive.engine.logits_processors``):
the tokens a request with a penalty has not handed the runner yet, and the tokens ``min_tokens``
keeps it from sampling. Requests without these extras get None and () at no cost."""

from __future__ import annotations

from kvhive.engine.step import TokenHistory
from kvhive.request import Request


def token_history(request: Request) -> TokenHistory | None:
    """On a chunk that samples: the request's tokens from the first one the runner lacks (all of
    them the first time, then the one sampled last step), marked as handed over; None without a
    penalty or when nothing is new (a request resumed after preemption whose tokens the runner has)."""
    if not request.sampling.uses_token_history:
        return None
    start, end = request.num_history_tokens_sent, request.num_tokens
    if start == end:
        return None
    request.num_history_tokens_sent = end
    return TokenHistory(start, tuple(request.all_token_ids[start:end]), request.num_prompt_tokens)


def suppressed_tokens(request: Request) -> tuple[int, ...]:
    """The tokens that cannot be sampled next: EOS (unless ``ignore_eos``) and ``stop_token_ids``
    while fewer than ``min_tokens`` tokens were generated, as vLLM does; () otherwise."""
    sampling = request.sampling
    if request.num_output_tokens >= sampling.min_tokens:
        return ()
    eos = () if sampling.ignore_eos else request.eos_token_ids
    return tuple(dict.fromkeys((*eos, *sampling.stop_token_ids)))
