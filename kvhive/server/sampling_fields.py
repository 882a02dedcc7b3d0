"""A request's sampling fields as the engine's ``SamplingParams``: what the request leaves unset
takes the model's defaults (``--generation-config``, ``kvhive.core.generation_defaults``), then
OpenAI's; vLLM's extras are checked against the vocabulary and each other, a 400 naming the field.

Fields that work on the text rather than the tokens (``skip_special_tokens``,
``include_stop_str_in_output``, stop strings before ``min_tokens``) are the stream's
(``kvhive.server.text_deltas.DeltaAssembler``); ``truncate_prompt_tokens`` is ``truncated_prompt``'s.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvhive.core.generation_defaults import SamplingDefaults
from kvhive.core.structured_spec import StructuredSpec
from kvhive.request import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_TOKENS, SamplingParams
from kvhive.server.errors import bad_request
from kvhive.server.protocol import SamplingRequest


def pick(value: float | None, default: float | None, neutral: float) -> float:
    """The request's value, else the model's default, else the neutral one."""
    if value is not None:
        return value
    return neutral if default is None else default


def logit_bias_of(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` (token id as a string -> bias) as (id, bias) pairs; 400 for more than
    MAX_LOGIT_BIAS_TOKENS entries, a key that is not a token id of the vocabulary, or a bias out
    of [-100, 100]."""
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS_TOKENS:
        raise bad_request(f"'logit_bias' holds at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(bias)}",
                          param="logit_bias")
    pairs = []
    for key, value in bias.items():
        token_id = int(key) if key.isascii() and key.isdigit() and len(key) <= 12 else -1
        if not 0 <= token_id < vocab_size:
            raise bad_request(f"'logit_bias' keys are token ids in [0, {vocab_size}), got {key[:40]!r}",
                              param="logit_bias")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise bad_request(f"'logit_bias' values are in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                              f"got {value} for token {token_id}", param="logit_bias")
        pairs.append((token_id, value))
    return tuple(pairs)


def sampling_params_for(body: SamplingRequest, max_tokens: int, defaults: SamplingDefaults, vocab_size: int,
                        logprobs: int | None = None, prompt_logprobs: int | None = None,
                        structured: StructuredSpec | None = None) -> SamplingParams:
    """Engine sampling parameters of ``body``; ``logprobs``: top alternatives per token (None: no
    logprobs), ``prompt_logprobs`` the same for the prompt. The body's fields are within their
    schema's bounds; 400 naming the field for what only the engine's bounds catch (``min_tokens``
    above ``max_tokens``)."""
    if body.min_tokens > max_tokens:
        raise bad_request(f"'min_tokens' ({body.min_tokens}) must not exceed the maximum number of output "
                          f"tokens ({max_tokens})", param="min_tokens")
    top_k = body.top_k if body.top_k is not None else defaults.top_k
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=pick(body.temperature, defaults.temperature, 1.0),
            top_p=pick(body.top_p, defaults.top_p, 1.0),
            top_k=max(0, top_k or 0),
            seed=body.seed,
            ignore_eos=body.ignore_eos,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            structured=structured,
            repetition_penalty=pick(body.repetition_penalty, defaults.repetition_penalty, 1.0),
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            min_p=pick(body.min_p, defaults.min_p, 0.0),
            min_tokens=body.min_tokens,
            logit_bias=logit_bias_of(body.logit_bias, vocab_size),
        )
    except ValueError as exc:
        raise bad_request(str(exc), param=str(exc).split(" ", 1)[0]) from exc


def truncated_prompt(token_ids: Sequence[int], truncate: int | None, max_model_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the last ``truncate`` tokens of the prompt (-1: the last
    max_model_len); None keeps it whole. 400 for 0 or a value above the context."""
    if truncate is None:
        return list(token_ids)
    if truncate == -1:
        truncate = max_model_len
    if not 1 <= truncate <= max_model_len:
        raise bad_request(f"'truncate_prompt_tokens' must be -1 or in [1, {max_model_len}] (the model's "
                          f"context), got {truncate}", param="truncate_prompt_tokens")
    return list(token_ids[-truncate:])
