"""The registry's session records in its backend: writes, reads, and whether the backend may lack them.

Without a backend nothing is written. A local backend's write that fails raises SessionNotDurable
(the server answers 507); its old record stays. With a shared one (Redis), ``want_republish`` notes (from
any thread) that the backend may lack the records held here; the registry then writes them again
before its next read. A corrupt record reads as no record.
"""

from __future__ import annotations

import logging

from kvhive.core.failure_log import FailureLog
from kvhive.sessions.backends import SessionBackend
from kvhive.sessions.errors import not_durable
from kvhive.sessions.session import Session
from kvhive.store.redis_guard import RedisUnavailable, backend_lost_data

logger = logging.getLogger(__name__)


class SessionRecords:
    """One backend's session records as the registry writes and reads them."""

    def __init__(self, backend: SessionBackend | None) -> None:
        self.backend = backend
        # Set from any thread when the shared backend may lack what is held here; cleared by the
        # republish (on the registry's own thread).
        self._republish_wanted = False
        self.losses = 0            # times told the backend may lack what is held here (any thread)
        self.write_failures = FailureLog(logger, "session records: writes failed")

    def save(self, session: Session) -> None:
        """Write the session's record. A local backend that cannot (a full disk, an I/O error)
        raises SessionNotDurable and keeps the record it had; failures are logged once per
        interval. A shared backend queues its writes (see ``want_republish`` for their loss). A
        session held in memory only is never written."""
        if self.backend is None or session.in_memory:
            return
        try:
            self.backend.save(session.to_json())
        except OSError as exc:
            self.write_failures.record(exc)
            raise not_durable(f"session '{session.session_id}'", exc) from exc
        except Exception:  # noqa: BLE001 - not a storage failure; the next change writes it again
            logger.exception("could not persist session %s", session.session_id)

    @staticmethod
    def parse(record: dict | None) -> Session | None:
        """A record as an idle session; None for no record or a corrupt one."""
        if record is None:
            return None
        try:
            return Session.from_json(record)
        except (KeyError, TypeError, ValueError):
            logger.exception("ignoring a corrupt session record")
            return None

    def read(self, owner: str | None, session_id: str, held: Session | None,
             losses: int) -> tuple[dict | None, bool]:
        """The backend's record (None: none, or unreadable) and whether Redis lost it: for a
        session held here and missing there, whether the backend lost its data, by its marker or
        by a loss noted since ``losses`` (another check found it first and republishes); then the
        session is republished, not ended. Blocking: any thread."""
        assert self.backend is not None
        try:
            record = self.backend.load(owner, session_id)
        except Exception as exc:  # noqa: BLE001 - backend down: what this replica holds is the best it knows
            # Quiet while Redis is unreachable: its breaker has logged that once.
            logger.log(logging.DEBUG if isinstance(exc, RedisUnavailable) else logging.WARNING,
                       "could not read session %s from the session backend (%s: %s)",
                       session_id, type(exc).__name__, exc)
            return None, True
        if record is not None or held is None:
            return record, False
        return None, backend_lost_data(self.backend) or self.losses != losses

    def load_all(self) -> list[Session]:
        """Every readable record of the backend as an idle session; none when it cannot be read."""
        assert self.backend is not None
        try:
            records = self.backend.load_all()
        except Exception:  # noqa: BLE001 - an unreadable registry starts empty rather than not at all
            logger.exception("could not load the session registry; starting with none")
            return []
        return [session for session in map(self.parse, records) if session is not None]

    def want_republish(self) -> None:
        """The backend may lack what this replica holds; any thread (it only sets a flag and counts)."""
        self.losses += 1
        self._republish_wanted = True

    def take_republish(self) -> bool:
        """Whether a republish is wanted; the flag is cleared."""
        wanted, self._republish_wanted = self._republish_wanted, False
        return wanted
