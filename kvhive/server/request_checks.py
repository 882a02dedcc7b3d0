"""Checks of the streaming and vLLM-extension fields completions and chat share, before anything
runs: each refusal a 400 naming the field."""

from __future__ import annotations

from kvhive.request import MAX_LOGPROBS
from kvhive.server.errors import bad_request
from kvhive.server.protocol import SamplingRequest


def check_stream_options(body: SamplingRequest) -> None:
    """400 for ``stream_options`` on a request that does not stream (as OpenAI and vLLM answer),
    and for ``continuous_usage_stats`` without ``include_usage`` (usage on every chunk is usage)."""
    options = body.stream_options
    if options is None:
        return
    if not body.stream:
        raise bad_request("'stream_options' can only be given when 'stream' is true", param="stream_options")
    if options.continuous_usage_stats and not options.include_usage:
        raise bad_request("'stream_options.continuous_usage_stats' needs 'stream_options.include_usage': true",
                          param="stream_options.continuous_usage_stats")


def check_prompt_logprobs(body: SamplingRequest) -> None:
    """400 for a ``prompt_logprobs`` (vLLM's field) out of bounds or on a streamed request (vLLM
    answers it only whole)."""
    asked = body.prompt_logprobs
    if asked is None:
        return
    if not 0 <= asked <= MAX_LOGPROBS:
        raise bad_request(f"'prompt_logprobs' must be between 0 and {MAX_LOGPROBS}, got {asked}",
                          param="prompt_logprobs")
    if body.stream:
        raise bad_request("'prompt_logprobs' are not available when 'stream' is true", param="prompt_logprobs")
