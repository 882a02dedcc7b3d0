"""OpenAI's ``prompt_cache_key``: the bound on its length, shared by the replica (which validates
the field) and the gateway and Ray router (which route by it and refuse a longer one before
routing anything)."""

from __future__ import annotations

# Longest prompt_cache_key accepted, in characters.
MAX_PROMPT_CACHE_KEY_CHARS = 1024


def prompt_cache_key_problem(value: object) -> str | None:
    """What the 400 for a ``prompt_cache_key`` of ``value`` says, or None when it is fine (absent,
    null, or a string of at most MAX_PROMPT_CACHE_KEY_CHARS characters). A value of another type is
    the replica's to refuse (its request model names the type)."""
    if isinstance(value, str) and len(value) > MAX_PROMPT_CACHE_KEY_CHARS:
        return (f"'prompt_cache_key' is too long: {len(value)} characters, at most "
                f"{MAX_PROMPT_CACHE_KEY_CHARS}")
    return None
