"""API keys as tenants: who owns a request, and the prefix-cache salt that keeps tenants apart.

Torch-free and dependency-free: the server calls these to salt a request's blocks, and the gateway
calls the same functions to compute the block keys the replica will announce.
"""

from __future__ import annotations

import hashlib


def key_owner(authorization: str) -> str:
    """A digest of the key in an ``Authorization: Bearer KEY`` header value (owns sessions, salts
    the cache); the key itself is never stored."""
    token = authorization.partition(" ")[2].strip()
    return hashlib.sha256(token.encode()).hexdigest()[:32]


def cache_salt(owner: str | None, body_salt: str | None, share_prefix_cache: bool) -> str | None:
    """The prefix-cache salt: the owner's digest joins the body's salt unless the cache is shared.

    Separate salts mean separate block hashes, so one key can never time another key's prefix hits
    (vLLM CVE-2025-46570).
    """
    if owner is None or share_prefix_cache:
        return body_salt
    return f"key:{owner}" if body_salt is None else f"key:{owner}:{body_salt}"
