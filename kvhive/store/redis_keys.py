"""The Redis key names of one served model: one namespace per model, ``kvhive:{model}:``.

    kvhive:{model}:kv:{store key}             a KV block (codec record; ``kvhive.store.key`` encodes
                                              layout, dtype, block size, fingerprint, block hash)
    kvhive:{model}:sessions:{owner}:{id}      a session record (JSON), expiring with the session
    kvhive:{model}:responses:{owner}:{id}     a conversation's stored responses (a hash), expiring
                                              with it
    kvhive:data-marker                        the data-loss marker (``kvhive.store.redis_guard``)

``{owner}`` is the API key's owner id, ``-`` without API keys. ``kvhive.sessions.durable`` says who
writes each and why the data marker stays global.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RedisKeys:
    """The Redis key prefixes of one served model (the module docstring lists the keys)."""

    model: str

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("Redis keys: the served model name must not be empty")

    @property
    def namespace(self) -> str:
        """``kvhive:{model}``: the start of every key of this model."""
        return f"kvhive:{self.model}"

    @property
    def kv_blocks(self) -> bytes:
        """What comes before a block's store key."""
        return f"{self.namespace}:kv:".encode()

    @property
    def sessions(self) -> str:
        """What comes before ``:{owner}:{id}`` of a session record."""
        return f"{self.namespace}:sessions"

    @property
    def responses(self) -> str:
        """What comes before ``:{owner}:{id}`` of a conversation's stored responses."""
        return f"{self.namespace}:responses"
