"""What a request body may hold (torch-free; the server and the gateway share it).

Every request model derives from ``StrictBody``: a field it does not declare is refused with a 400
naming its path ("Unrecognized request argument supplied: messages[0].foo"), never ignored, and
"5" is not an integer nor "true" a boolean, as in OpenAI's API. The error is written in one place,
``kvhive.core.json_body.validation_body_error``.

A few fields are declared only so that clients written for OpenAI keep working: kvhive accepts
them and does nothing with them, because doing nothing gives the answer the client asked for.
They are the ``NO_OP_FIELDS`` below, each with the reason; docs/api_fields.md lists them. A field
whose meaning kvhive cannot honour and that would change the answer is never one of them: it is
refused by name.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from types import MappingProxyType
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

# What the 400 for an undeclared field says (OpenAI's and vLLM's wording), with its path.
UNRECOGNIZED_FIELD = "Unrecognized request argument supplied: {}"

# Longest value of a free-text no-op field (OpenAI's bound on ``safety_identifier`` is 64).
MAX_NO_OP_TEXT_CHARS = 256
# The type of a free-text no-op field.
NoOpText = Annotated[str, Field(max_length=MAX_NO_OP_TEXT_CHARS)]

# Longest ``prompt_cache_key`` (OpenAI's routing key for its prompt cache; the gateway routes by it).
MAX_PROMPT_CACHE_KEY_CHARS = 1024
PromptCacheKey = Annotated[str, Field(max_length=MAX_PROMPT_CACHE_KEY_CHARS)]
# OpenAI's values of ``prompt_cache_retention`` (kvhive.server.prompt_cache says what each pins).
PromptCacheRetention = Literal["in_memory", "24h"]

# The fields of a text content part (the others belong to other kinds of part).
TEXT_PART_FIELDS = frozenset({"type", "text"})

# field -> (the endpoints that accept it as a no-op, why ignoring it is safe).
NO_OP_FIELDS: Mapping[str, tuple[str, str]] = MappingProxyType({
    "user": ("completions, chat completions, responses",
             "an end-user id for the provider's abuse monitoring; it never changes the output"),
    "safety_identifier": ("chat completions, responses",
                          "the successor of `user`: an end-user id for abuse monitoring; it never "
                          "changes the output"),
    "service_tier": ("chat completions, responses",
                     "the provider's processing tier (latency and price); one server has one tier, "
                     "and the output is the same"),
    "store": ("chat completions",
              "asks the provider to keep the completion for its dashboard (distillation, evals); "
              "kvhive keeps no chat completions, and the output is the same (on `/v1/responses` "
              "`store` is honoured)"),
    "metadata": ("chat completions",
                 "tags for stored completions (at most 16 pairs, as OpenAI bounds them); nothing is "
                 "stored, and the output is the same (on `/v1/responses` it is stored)"),
})


class StrictBody(BaseModel):
    """The base of every request model: strict types, undeclared fields refused."""

    model_config = ConfigDict(strict=True, extra="forbid")


def stray_field(body: BaseModel, own: Collection[str]) -> str | None:
    """The first field set (not null) on ``body`` outside ``own``: on a content part of one kind, a
    field that belongs to another kind (an ``image_url`` on a text part), which would otherwise be
    declared and ignored; None when there is none."""
    return next((name for name in body.model_fields_set if name not in own and getattr(body, name) is not None),
                None)


def stray_field_message(name: str, kind: str) -> str:
    """What the 400 for a ``stray_field`` says."""
    return f"'{name}' does not belong in a content part of type '{kind}'"
