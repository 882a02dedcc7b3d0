"""The API dialect of a routed path: Anthropic's on ``/v1/messages`` and below it
(``count_tokens``), OpenAI's everywhere else. It decides the shape of the errors the gateway
answers itself and how a replica's error body is re-shaped (Anthropic's shape itself:
``kvhive.core.anthropic_errors``); ``x-api-key`` carries the key of Anthropic's clients.
"""

from __future__ import annotations

MESSAGES_PATH = "/v1/messages"
# The Messages routes the gateway routes like chat (by the prompt's KV score).
ANTHROPIC_PATHS = frozenset((MESSAGES_PATH, "/v1/messages/count_tokens"))
# The header Anthropic's clients send their key in.
API_KEY_HEADER = "x-api-key"


def is_anthropic(path: str) -> bool:
    """Whether ``path`` speaks Anthropic's Messages API: /v1/messages and every path below it."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")
