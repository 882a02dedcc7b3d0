"""API keys as tenants: who owns a request, and the prefix-cache salt that keeps tenants apart.

Torch-free and dependency-free: the server calls these to salt a request's blocks, and the gateway
calls the same functions to compute the block keys the replica will announce.
"""

from __future__ import annotations

import hashlib


def presented_key(authorization: str | None, x_api_key: str | None = None) -> str:
    """The API key a request presents: the one in ``Authorization: Bearer KEY`` when that header is
    sent, else Anthropic's ``x-api-key: KEY`` ("" when neither is)."""
    if authorization:
        return authorization.partition(" ")[2].strip()
    return (x_api_key or "").strip()


def key_owner(authorization: str | None, x_api_key: str | None = None) -> str:
    """A digest of the key a request presents (``presented_key``; owns sessions, salts the cache);
    the key itself is never stored."""
    token = presented_key(authorization, x_api_key)
    return hashlib.sha256(token.encode()).hexdigest()[:32]


def cache_salt(owner: str | None, body_salt: str | None, share_prefix_cache: bool) -> str | None:
    """The prefix-cache salt: the owner's digest joins the body's salt unless the cache is shared.

    Separate salts mean separate block hashes, so one key can never time another key's prefix hits
    (vLLM CVE-2025-46570).
    """
    if owner is None or share_prefix_cache:
        return body_salt
    return f"key:{owner}" if body_salt is None else f"key:{owner}:{body_salt}"
