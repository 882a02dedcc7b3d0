"""``--speculative-config``: speculative decoding's method and draft length, in vLLM's field names.

The JSON object takes vLLM's ``SpeculativeConfig`` keys for the n-gram (prompt lookup) method:
``method`` ("ngram"), ``num_speculative_tokens`` (required: the most draft tokens a step verifies),
``prompt_lookup_min`` and ``prompt_lookup_max`` (the n-gram lengths looked up, longest first).
Where both lookup bounds are omitted they are 5 (vLLM's default); where one is omitted it takes
the other's value. kvhive's own method "history" drafts from the request's tokens first, then from
the server's recent token sequences of the same tenant; its keys ``history_max_tokens`` (all
tenants) and ``history_tenant_max_tokens`` (one tenant; at most the first) bound that store.
kvhive's ``draft_sizing`` says how many draft tokens a step verifies: "step_cost" (the default)
keeps, over all requests in decode together, those that raise the step's expected tokens per
second by its measured cost (``kvhive.engine.speculative.step_cost``); "per_request" drafts each
request's adaptive length whatever the batch. vLLM's ``disable_by_batch_size`` N turns drafting
off for every step that runs more than N requests (the batch's plain steps then cost nothing
extra). Any other key, a history key without method "history", a wrong type or a value out of range is a
``ValueError`` that names it (``kvhive serve`` exits 2).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvhive.core.flag_values import json_flag_object

OPTION = "--speculative-config"
METHODS = ("ngram", "history")
HISTORY_KEYS = ("history_max_tokens", "history_tenant_max_tokens")
DRAFT_SIZINGS = ("step_cost", "per_request")
JSON_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", *HISTORY_KEYS,
             "draft_sizing", "disable_by_batch_size")
MAX_SPECULATIVE_TOKENS = 16
MAX_LOOKUP = 16
DEFAULT_LOOKUP = 5
# The history store's token caps: all tenants together, and one tenant (never above the first).
MAX_HISTORY_TOKENS = 100_000_000
DEFAULT_HISTORY_TOKENS = 1_000_000
DEFAULT_TENANT_HISTORY_TOKENS = 250_000
MAX_BATCH_SIZE = 65536
# The integer fields and their most (each at least 1).
BOUNDS = {"num_speculative_tokens": MAX_SPECULATIVE_TOKENS, "prompt_lookup_min": MAX_LOOKUP,
          "prompt_lookup_max": MAX_LOOKUP, "history_max_tokens": MAX_HISTORY_TOKENS,
          "history_tenant_max_tokens": MAX_HISTORY_TOKENS, "disable_by_batch_size": MAX_BATCH_SIZE}


@dataclass(frozen=True)
class SpeculativeConfig:
    """How decode steps draft tokens for the target model to verify in one forward pass."""

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_min: int = DEFAULT_LOOKUP
    prompt_lookup_max: int = DEFAULT_LOOKUP
    # Method "history": the most tokens its store keeps for all tenants, and for one tenant.
    history_max_tokens: int = DEFAULT_HISTORY_TOKENS
    history_tenant_max_tokens: int = DEFAULT_TENANT_HISTORY_TOKENS
    draft_sizing: str = "step_cost"
    # Steps that run more requests than this draft nothing; None: no such limit.
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"{OPTION}: unknown method {self.method!r} (known: {', '.join(METHODS)})")
        if self.draft_sizing not in DRAFT_SIZINGS:
            raise ValueError(f"{OPTION}: draft_sizing must be one of {', '.join(DRAFT_SIZINGS)}, "
                             f"got {self.draft_sizing!r}")
        for key in BOUNDS:
            if getattr(self, key) is not None:
                _check_bound(key, getattr(self, key))
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"{OPTION}: prompt_lookup_min ({self.prompt_lookup_min}) is above "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.history_tenant_max_tokens > self.history_max_tokens:
            raise ValueError(f"{OPTION}: history_tenant_max_tokens ({self.history_tenant_max_tokens}) is "
                             f"above history_max_tokens ({self.history_max_tokens})")


def parse_speculative_config(text: str | None) -> SpeculativeConfig | None:
    """The config of ``--speculative-config`` JSON; None when the flag is not given (no speculation)."""
    if text is None:
        return None
    values = json_flag_object(OPTION, text)
    unknown = sorted(set(values) - set(JSON_KEYS))
    if unknown:
        raise ValueError(f"{OPTION}: unknown key{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(map(repr, unknown))} (known: {', '.join(JSON_KEYS)})")
    if "num_speculative_tokens" not in values:
        raise ValueError(f"{OPTION}: num_speculative_tokens is required")
    for key, value in values.items():
        if key in BOUNDS:
            _check_bound(key, value)      # the key given is named, not the one filled from it
    method = values.get("method", "ngram")
    given_history = [key for key in HISTORY_KEYS if key in values]
    if given_history and method != "history":
        raise ValueError(f"{OPTION}: {given_history[0]} needs method \"history\" (the method is {method!r})")
    low, high = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
    if low is None and high is None:
        low = high = DEFAULT_LOOKUP
    low = high if low is None else low
    high = low if high is None else high
    total = values.get("history_max_tokens", DEFAULT_HISTORY_TOKENS)
    tenant = values.get("history_tenant_max_tokens", min(DEFAULT_TENANT_HISTORY_TOKENS, total))
    return SpeculativeConfig(num_speculative_tokens=values["num_speculative_tokens"], method=method,
                             prompt_lookup_min=low, prompt_lookup_max=high, history_max_tokens=total,
                             history_tenant_max_tokens=tenant,
                             draft_sizing=values.get("draft_sizing", "step_cost"),
                             disable_by_batch_size=values.get("disable_by_batch_size"))


def _check_bound(key: str, value: object) -> None:
    """ValueError naming the flag and ``key`` unless ``value`` is an integer in 1..BOUNDS[key]."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= BOUNDS[key]:
        raise ValueError(f"{OPTION}: {key} must be an integer in 1..{BOUNDS[key]}, got {value!r}")
