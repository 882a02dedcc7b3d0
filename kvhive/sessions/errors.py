"""The kinds of session errors: a request about a session (or a stored response) that cannot be served.

A domain error names its kind by its class and its reason by ``code``; the server maps each kind
to an HTTP status in one place (``kvhive/server/errors.py``).
"""

from __future__ import annotations

import errno


class SessionError(Exception):
    """A request about a session (or a stored response) that cannot be served: its kind is the
    subclass; ``code`` and ``param`` name the reason and the field (the server maps kinds to statuses)."""

    def __init__(self, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param


class SessionInvalid(SessionError):
    """The request names a session wrongly: a malformed id or TTL, another model's session."""


class SessionNotFound(SessionError):
    """No such live session (or stored response) for this caller: unknown, expired, deleted or another key's."""


class SessionBusy(SessionError):
    """The session is running another turn; nothing changed."""


class SessionStale(SessionError):
    """The request's ``turn_number`` is not the session's next turn (a stale or out-of-order turn); nothing changed."""


class SessionLimit(SessionError):
    """A limit (sessions per key, KV per key, the keeper tier, responses per conversation) refuses it."""


class SessionNotDurable(SessionError):
    """The record of a new session, a turn or a stored response could not be written durably (the
    disk is full, a quota, an I/O error); the record written before stays as it was."""


def not_durable(what: str, exc: OSError) -> SessionNotDurable:
    """``what`` (e.g. "session 'sess-…'") could not be written: code ``insufficient_storage`` for a
    full disk or quota, ``storage_error`` for another I/O error."""
    full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return SessionNotDurable(f"The record of {what} could not be written to disk ({exc.strerror or exc}), "
                             f"so it would not survive a restart; try again later",
                             "insufficient_storage" if full else "storage_error")


def not_found(session_id: str) -> SessionNotFound:
    """An id that is unknown, expired, deleted or another key's."""
    return SessionNotFound(f"Session '{session_id}' does not exist (unknown, expired or deleted)",
                           "session_not_found", "x-session-id")

