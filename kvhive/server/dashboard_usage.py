"""Usage per API key: requests, prompt and generated tokens, for the live page's usage table.

``KeyUsageMiddleware`` counts each POST under ``/v1`` against the caller's key digest
(``kvhive.core.tenancy.key_owner``; the key itself is never kept) and, for the request's lifetime,
puts that key's ``KeyUsage`` in ``CURRENT_KEY_USAGE``, where ``RequestMetrics.finish`` adds the
request's tokens: each engine request a POST runs (its ``n`` choices too) counts its tokens once.
At most ``MAX_TRACKED_KEYS`` digests get a row of their own; later ones share ``OTHER_KEYS``.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from kvhive.core.tenancy import key_owner

MAX_TRACKED_KEYS = 256
# The row of requests sent without a key (a server without --api-key) and of keys past the bound.
NO_KEY = "-"
OTHER_KEYS = "other"


@dataclass
class KeyUsage:
    """Counters of one key (cumulative since start)."""

    requests: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0

    def add_tokens(self, prompt_tokens: int, generation_tokens: int) -> None:
        """Count one finished engine request's tokens."""
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += generation_tokens


# The usage row of the request being served (None outside a counted request).
CURRENT_KEY_USAGE: ContextVar[KeyUsage | None] = ContextVar("kvhive_current_key_usage", default=None)


class KeyUsageTable:
    """Usage by key digest, at most ``max_keys`` rows plus ``OTHER_KEYS``."""

    def __init__(self, max_keys: int = MAX_TRACKED_KEYS) -> None:
        self.max_keys = max_keys
        self._rows: dict[str, KeyUsage] = {}

    def row(self, owner: str) -> KeyUsage:
        """The row of ``owner`` (a digest, or NO_KEY), made if there is room, else OTHER_KEYS's."""
        usage = self._rows.get(owner)
        if usage is None:
            if len(self._rows) >= self.max_keys and owner != OTHER_KEYS:
                return self.row(OTHER_KEYS)
            usage = self._rows[owner] = KeyUsage()
        return usage

    def get(self, owner: str) -> KeyUsage | None:
        """The row of ``owner`` if it has one (changes nothing)."""
        return self._rows.get(owner)

    def items(self) -> list[tuple[str, KeyUsage]]:
        """Every row, the busiest first."""
        return sorted(self._rows.items(), key=lambda item: -item[1].requests)


class KeyUsageMiddleware:
    """Counts POSTs under /v1 per key and makes their row ``CURRENT_KEY_USAGE`` while they run.

    Installed inside the API-key check, so only requests with a valid key (or any, without keys) count."""

    def __init__(self, app: ASGIApp, table: KeyUsageTable, keyed: bool) -> None:
        self.app = app
        self.table = table
        self.keyed = keyed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Count the request and run it with its row set; other requests pass through untouched."""
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].startswith("/v1"):
            await self.app(scope, receive, send)
            return
        usage = self.table.row(self.owner(scope))
        usage.requests += 1
        token = CURRENT_KEY_USAGE.set(usage)
        try:
            await self.app(scope, receive, send)
        finally:
            CURRENT_KEY_USAGE.reset(token)

    def owner(self, scope: Scope) -> str:
        """The request's key digest (NO_KEY on a server without keys)."""
        if not self.keyed:
            return NO_KEY
        headers = dict(scope["headers"])
        authorization, x_api_key = headers.get(b"authorization"), headers.get(b"x-api-key")
        return key_owner(authorization.decode("latin-1") if authorization else None,
                         x_api_key.decode("latin-1") if x_api_key else None)
