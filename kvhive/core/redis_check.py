"""The startup check of a Redis URL's credentials (torch-free; the replica and the gateway share it).

A Redis that cannot be reached is a runtime fault: kvhive starts, runs without it and reconnects
when it comes back (``kvhive.store.redis_guard``). A Redis that answers but refuses this process
(a wrong or missing password, a user without the rights, a database index the server lacks) is a
misconfiguration that waiting cannot fix, so startup stops on it (exit 2) instead of serving
quietly without what the URL was meant to provide.
"""

from __future__ import annotations

from urllib.parse import urlsplit

# Seconds the check waits for a connection and for each answer before it calls Redis unreachable.
CHECK_TIMEOUT_S = 3.0


def redacted(url: str) -> str:
    """The URL without its password, for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return parts._replace(netloc=f"{parts.username or ''}:***@{host}{port}").geturl()


def redis_refusal(url: str, flag: str, timeout_s: float = CHECK_TIMEOUT_S) -> str | None:
    """Why the Redis at ``url`` (given as ``flag``) refuses this process: its answer to a
    connection, AUTH, SELECT and PING, as a message naming the flag and the URL (password
    redacted); None when it accepts them or cannot be reached now."""
    import redis  # optional dependency: only a Redis URL needs it
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                  retry=Retry(NoBackoff(), 0))
    try:
        client.ping()
    except redis.AuthenticationError as exc:      # a ConnectionError subclass: first
        return f"{flag} {redacted(url)}: Redis refused the credentials ({exc})"
    except (redis.ConnectionError, redis.TimeoutError):
        return None                     # unreachable, or not answering yet: a runtime fault
    except redis.ResponseError as exc:  # NOPERM, an out-of-range database index, ...
        return f"{flag} {redacted(url)}: Redis refused the connection ({exc})"
    finally:
        client.close()
    return None
