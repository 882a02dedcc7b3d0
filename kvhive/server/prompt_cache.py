"""The prompt-cache fields of completions, chat completions and responses, and what each asks for.

- ``kv_cache_retention_config`` (completions, chat completions, responses; TensorRT-LLM's shape,
  ``kvhive.core.retention.parse_retention``): priorities and durations of prompt token ranges and
  of the generated tokens, handed to the engine; a range outside the prompt is a 400 naming it.
- ``prompt_cache_retention`` (chat completions, responses; OpenAI's ``"in_memory"`` or ``"24h"``):
  pins the whole prompt (``kvhive.sessions.prefix_pins``) for ``PROMPT_CACHE_RETENTION_TTL_S``,
  within the API key's session budgets: in_memory on the device only, 24h in the store tiers too,
  surviving a restart; a retention longer than ``--max-session-ttl`` is a 400 naming the field
  and pins nothing (``in_memory`` is shortened to the cap instead).
- ``prompt_cache_key`` (chat completions, responses; OpenAI's): the gateway's routing key, bounded
  by ``MAX_PROMPT_CACHE_KEY_CHARS`` (``kvhive.core.request_fields``); the replica reads nothing from it.

``open_prompt_cache`` turns the fields into a ``PromptCache`` (``open_pins`` does it for other
dialects' breakpoints, Anthropic's ``cache_control``): the retention the engine gets (the
client's ranges plus the pins') and the pins' turn, which the request's stream ends
(``GenerationService.stream``); after it, ``PromptCache.pins.usage`` holds Anthropic's counters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvhive.core.retention import (
    RetentionError,
    RetentionSpec,
    cap_durations,
    check_ranges_within,
    parse_retention,
)
from kvhive.server.errors import bad_request
from kvhive.sessions.prefix_pins import Breakpoint, CacheUsage, PinTurn

if TYPE_CHECKING:
    from fastapi import Request

    from kvhive.server.generation import GenerationService

# The TTL each of OpenAI's ``prompt_cache_retention`` values pins the prompt for: in_memory as
# long as OpenAI keeps an in-memory prefix after its last use (5 minutes), 24h a day.
PROMPT_CACHE_RETENTION_TTL_S: dict[str, int] = {"in_memory": 300, "24h": 86400}
RETENTION_CONFIG_PARAM = "kv_cache_retention_config"
PROMPT_CACHE_RETENTION_PARAM = "prompt_cache_retention"


@dataclass(frozen=True)
class PromptCache:
    """What one request asks of the cache: the client's retention and the pins' turn."""

    retention: RetentionSpec | None = None
    pins: PinTurn | None = None

    @property
    def engine_retention(self) -> RetentionSpec | None:
        """The retention the engine gets: the client's ranges plus each pin's."""
        return self.retention if self.pins is None else self.pins.merged_retention(self.retention)

    def without_pins(self) -> PromptCache:
        """The same retention for a request that does not end the pins (another choice of ``n``)."""
        return PromptCache(self.engine_retention)

    def end(self, block_hashes: Sequence[bytes] | None, cached_tokens: int) -> CacheUsage | None:
        """End the pins' turn (once; ``PinTurn.end``); None without pins."""
        return None if self.pins is None else self.pins.end(block_hashes, cached_tokens)


NO_PROMPT_CACHE = PromptCache()


def client_retention(value: dict[str, Any] | None, num_prompt_tokens: int, max_ttl_s: int) -> RetentionSpec | None:
    """The request's ``kv_cache_retention_config`` as a spec (None when absent), its durations within
    ``max_ttl_s`` (``cap_durations``); 400 naming the field for a bad value, a range outside the
    prompt or a duration over the cap."""
    if value is None:
        return None
    try:
        spec = parse_retention(value, RETENTION_CONFIG_PARAM)
        check_ranges_within(spec, num_prompt_tokens, RETENTION_CONFIG_PARAM)
        spec = cap_durations(spec, max_ttl_s, RETENTION_CONFIG_PARAM)
    except RetentionError as exc:
        raise bad_request(str(exc), param=exc.param) from None
    return spec


def retention_breakpoints(value: str | None, num_prompt_tokens: int, max_ttl_s: int) -> list[Breakpoint]:
    """The pin ``prompt_cache_retention`` asks for: the whole prompt for the value's TTL; none when
    absent. in_memory is a device priority only (``Breakpoint.in_memory``), at most ``max_ttl_s``
    long; 24h also pins in the store tiers and persists, and the pins refuse it over the cap."""
    if value is None:
        return []
    ttl = PROMPT_CACHE_RETENTION_TTL_S[value]
    if value == "in_memory":
        return [Breakpoint(num_prompt_tokens, min(ttl, max_ttl_s), in_memory=True)]
    return [Breakpoint(num_prompt_tokens, ttl)]


async def open_prompt_cache(service: GenerationService, raw_request: Request, model: str,
                            token_ids: Sequence[int], cache_salt: str | None, *,
                            retention_config: dict[str, Any] | None = None,
                            prompt_cache_retention: str | None = None) -> PromptCache:
    """The request's ``PromptCache`` from OpenAI's and TensorRT-LLM's fields: its retention checked
    (400) and its pins opened (``open_pins``)."""
    retention = client_retention(retention_config, len(token_ids), service.sessions.config.max_ttl_s)
    breakpoints = retention_breakpoints(prompt_cache_retention, len(token_ids), service.sessions.config.max_ttl_s)
    return await open_pins(service, raw_request, model, token_ids, breakpoints, cache_salt, retention,
                           PROMPT_CACHE_RETENTION_PARAM)


async def open_pins(service: GenerationService, raw_request: Request, model: str, token_ids: Sequence[int],
                    breakpoints: Sequence[Breakpoint], cache_salt: str | None,
                    retention: RetentionSpec | None = None, param: str = "cache_control") -> PromptCache:
    """A ``PromptCache`` of the caller's pins of these breakpoints (``PrefixPins.open``: a
    SessionError naming ``param`` before anything changes, 400 for a TTL over
    --max-session-ttl, 429 over the key's budgets) and ``retention``, the client's own."""
    if not breakpoints:
        return PromptCache(retention)
    pins = await service.sessions.prefix_pins.open(service.owner_of(raw_request), model, token_ids, breakpoints,
                                                   cache_salt=cache_salt, param=param)
    return PromptCache(retention, pins)
