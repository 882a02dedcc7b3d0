"""Session affinity: which replica holds each session (``x-session-id``, ``conversation_id``) and
each stored response (``previous_response_id``, ``/v1/responses/{id}``), per tenant.

Replicas keep sessions and stored responses per owner (a digest of the caller's API key,
``kvhive.core.tenancy.key_owner``): another key's id is unknown to them. The gateway keys what it
learned the same way, by (owner, id), so a request is routed, and labelled, by what its own key
holds only: an id another key holds routes exactly as an id nobody holds. ``SessionAffinity`` is
one gateway's map; ``SharedAffinity`` shares it with every gateway on the same Redis.

A request's ``prompt_cache_key`` is kept the same way, in a map of its own: (owner, key) -> the
replica that last answered it, so one tenant's keys never steer another's requests. A key longer
than the replica accepts (``cache_key_problem``) is refused before anything is routed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import threading
from collections import OrderedDict

from kvhive.core.request_fields import MAX_PROMPT_CACHE_KEY_CHARS
from kvhive.routing.redis_link import RedisLink, SharedStateUnavailable

SESSION_HEADER = "x-session-id"
# A replica names a response it stored in this header (kvhive.server.responses).
RESPONSE_ID_HEADER = "x-kvhive-response-id"


def cache_key_problem(value: object) -> str | None:
    """What the 400 for a ``prompt_cache_key`` of ``value`` says, or None when it routes or is
    absent: a string of more than MAX_PROMPT_CACHE_KEY_CHARS characters is refused (a value of
    another type is the replica's to refuse; its request model names the type)."""
    if isinstance(value, str) and len(value) > MAX_PROMPT_CACHE_KEY_CHARS:
        return (f"'prompt_cache_key' is too long: {len(value)} characters, at most "
                f"{MAX_PROMPT_CACHE_KEY_CHARS}")
    return None


class SessionAffinity:
    """(owner, session or response id) -> replica name, learned from answers that carry
    ``x-session-id`` or ``x-kvhive-response-id`` (bounded LRU shared by all owners; session and
    response ids never look alike)."""

    def __init__(self, max_sessions: int = 100_000) -> None:
        self.max_sessions = max_sessions
        # Least recently used first; written by the event loop and by SharedAffinity's threads.
        self._replica_of: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._replica_of)

    def get(self, owner: str, session_id: str) -> str | None:
        """The replica that last served ``owner``'s ``session_id``, or None (also when only
        another owner used that id)."""
        key = (owner, session_id)
        with self._lock:
            replica = self._replica_of.get(key)
            if replica is not None:
                self._replica_of.move_to_end(key)
        return replica

    def remember(self, owner: str, session_id: str, replica: str) -> None:
        """Record that ``replica`` holds ``owner``'s ``session_id``."""
        key = (owner, session_id)
        with self._lock:
            self._replica_of[key] = replica
            self._replica_of.move_to_end(key)
            while len(self._replica_of) > self.max_sessions:
                self._replica_of.popitem(last=False)

    def forget(self, owner: str, session_id: str) -> None:
        """Drop ``owner``'s ``session_id`` (it was deleted)."""
        with self._lock:
            self._replica_of.pop((owner, session_id), None)

    # The event loop's calls: this map answers at once.
    async def aget(self, owner: str, session_id: str) -> str | None:
        """``get`` for the event loop."""
        return self.get(owner, session_id)

    async def aremember(self, owner: str, session_id: str, replica: str) -> None:
        """``remember`` for the event loop."""
        self.remember(owner, session_id, replica)

    async def aforget(self, owner: str, session_id: str) -> None:
        """``forget`` for the event loop."""
        self.forget(owner, session_id)


class SharedAffinity:
    """``SessionAffinity`` shared by every gateway on one Redis (``--redis-url``), over a local map.

    Each holder a gateway learns is written to Redis (``kvhive:affinity:<digest of owner and id>``
    -> replica URL, expiring ``ttl_s`` after its last use, which should be no shorter than the
    replicas' longest session TTL) and to the local map; a lookup reads Redis first, so a session
    created through one gateway and continued through another lands on its holder. While Redis
    cannot be reached (``RedisLink``'s back-off) the local map answers alone. Each call is one
    short Redis round trip (the link's timeout bounds it); the event loop's ``a*`` calls make it on
    a worker thread, so a slow Redis delays only the requests that wait on it.
    """

    def __init__(self, link: RedisLink, ttl_s: int, local: SessionAffinity | None = None,
                 prefix: str = "kvhive:affinity:") -> None:
        self.link = link
        self.ttl_s = ttl_s
        self.local = local if local is not None else SessionAffinity()
        self.prefix = prefix

    def __len__(self) -> int:
        return len(self.local)

    def _key(self, owner: str, session_id: str) -> str:
        # A digest: ids are client strings of any length; the owner is already a digest.
        digest = hashlib.sha256(f"{owner}\n{session_id}".encode(errors="surrogatepass")).hexdigest()
        return self.prefix + digest[:40]

    def get(self, owner: str, session_id: str) -> str | None:
        """The replica holding ``owner``'s ``session_id``: as Redis says (refreshing its expiry),
        else as this gateway last learned it."""
        key = self._key(owner, session_id)
        try:
            found = self.link.call(lambda: self.link.client.getex(key, ex=self.ttl_s))
        except SharedStateUnavailable:
            found = None
        if found is None:
            return self.local.get(owner, session_id)
        replica = found.decode(errors="replace")
        self.local.remember(owner, session_id, replica)
        return replica

    def remember(self, owner: str, session_id: str, replica: str) -> None:
        """Record that ``replica`` holds ``owner``'s ``session_id``, here and in Redis."""
        self.local.remember(owner, session_id, replica)
        key = self._key(owner, session_id)
        with contextlib.suppress(SharedStateUnavailable):
            self.link.call(lambda: self.link.client.set(key, replica, ex=self.ttl_s))

    def forget(self, owner: str, session_id: str) -> None:
        """Drop ``owner``'s ``session_id`` (it was deleted), here and in Redis."""
        self.local.forget(owner, session_id)
        key = self._key(owner, session_id)
        with contextlib.suppress(SharedStateUnavailable):
            self.link.call(lambda: self.link.client.delete(key))

    async def aget(self, owner: str, session_id: str) -> str | None:
        """``get`` off the event loop."""
        return await asyncio.to_thread(self.get, owner, session_id)

    async def aremember(self, owner: str, session_id: str, replica: str) -> None:
        """``remember`` off the event loop."""
        await asyncio.to_thread(self.remember, owner, session_id, replica)

    async def aforget(self, owner: str, session_id: str) -> None:
        """``forget`` off the event loop."""
        await asyncio.to_thread(self.forget, owner, session_id)
