"""The expiring-record store: records by (owner, id), each with an expiry, held in memory and
persisted in a backend (a disk directory, Redis, or none). Torch-free.

Sessions (``kvhive.sessions.registry``) and the conversations of stored responses
(``kvhive.sessions.response_store``) are both records of an ``ExpiringStore``; each of those keeps
only what is its own (a session's blocks and limits; a conversation's responses).

Rules, in one place:

- Keys: a record is held under (owner, id); another owner's record is another record.
- Load on start: a local backend's records are all held at start (expired ones too, for the sweep
  to drop); a shared backend (Redis) holds none at start, a record is read on use (``fetch``).
- Writes: a local backend that cannot write (OSError: a full disk, an I/O error) raises
  SessionNotDurable, counted in ``write_failures`` and logged once per interval; another failure is
  logged (a shared backend queues its writes and republishes what it lost).
- Reads of a shared backend run on any thread (``afetch`` reads off the event loop). A record
  missing there that this replica holds is "lost", not "ended elsewhere", when the backend could
  not be read or lost its data (its marker, or a loss noted while the read ran).
- Republish: ``want_republish`` (any thread: it sets a flag and counts) notes that the backend may
  lack what is held here; the next ``fetch`` or ``republish_if_wanted`` writes every live record
  held here again.
- Sweep: ``pop_expired`` drops the records that ``can_sweep``; a local backend's records go too, a
  shared backend's expire in Redis on their own (another replica may have extended one since).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

from kvhive.core.failure_log import FailureLog
from kvhive.sessions.errors import not_durable
from kvhive.store.redis_guard import RedisUnavailable, backend_lost_data, check_backend_data

logger = logging.getLogger(__name__)

RecordKey = tuple[str | None, str]       # (owner, id)


class RecordBackend(Protocol):
    """Where records persist, one JSON record per (owner, id) whose ``expires`` is its unix expiry."""

    shared: bool     # other replicas write it too: re-read a record on each use, never load all

    def load_all(self) -> list[dict[str, Any]]:
        """The records to hold at start: every record of a local backend, none of a shared one."""

    def load(self, owner: str | None, record_id: str) -> dict[str, Any] | None:
        """The record, or None if there is none (never saved, deleted, or expired in Redis)."""

    def save(self, record: dict[str, Any]) -> None:
        """Create or replace the record (``record["id"]``, ``record["owner"]``)."""

    def delete(self, owner: str | None, record_id: str) -> None:
        """Forget the record (no error if there is none)."""


class ExpiringRecord(Protocol):
    """What the store needs of a record: its key, its expiry, and its persisted form."""

    owner: str | None
    expires: float

    @property
    def record_id(self) -> str:
        """Its id (unique per owner)."""

    @property
    def written(self) -> bool:
        """Whether the backend keeps it (False: held in this process only, never written)."""

    def is_live(self, now: float) -> bool:
        """Whether it is in use at ``now``: found by lookups, republished."""

    def can_sweep(self, now: float) -> bool:
        """Whether the sweep drops it at ``now``."""

    def to_json(self) -> dict[str, Any]:
        """The record the backend stores."""


R = TypeVar("R", bound=ExpiringRecord)


class BackendRead(NamedTuple):
    """One record as a shared backend had it."""

    record: dict[str, Any] | None      # None: no record there, or unreadable
    lost: bool                         # keep what is held here: unreadable, or Redis lost its data


class ExpiringStore(Generic[R]):
    """Records held by (owner, id), loaded from and written to one backend."""

    def __init__(self, backend: RecordBackend | None, parse: Callable[[dict[str, Any]], R], noun: str,
                 failure_label: str, clock: Callable[[], float] = time.time) -> None:
        """``parse`` reads a backend record (KeyError, TypeError, ValueError: corrupt); ``noun``
        names a record in log lines; ``failure_label`` names the write failures' log line."""
        self.backend = backend
        self.noun = noun
        self.clock = clock
        self._parse = parse
        self._held: dict[RecordKey, R] = {}
        # Set from any thread when the shared backend may lack what is held here; cleared by the
        # republish (on the owner's own thread).
        self._republish_wanted = False
        self.losses = 0            # times told the backend may lack what is held here (any thread)
        self.write_failures = FailureLog(logger, f"{failure_label}: writes failed")
        if backend is not None:
            add_listener = getattr(backend, "add_listener", None)
            if add_listener is not None:
                add_listener(self.want_republish)
            self._load_all()

    # ------------------------------------------------------------------ held records

    def held(self, owner: str | None, record_id: str) -> R | None:
        """The record held under (owner, id), live or not; None if none."""
        return self._held.get((owner, record_id))

    def holds(self, record: R) -> bool:
        """Whether this very record is the one held under its key."""
        return self._held.get((record.owner, record.record_id)) is record

    def count(self) -> int:
        """How many records are held here (live or not yet swept)."""
        return len(self._held)

    def __iter__(self) -> Iterator[R]:
        return iter(self._held.values())

    def owned(self, owner: str | None) -> Iterator[R]:
        """The owner's records held here, expired ones included."""
        return (r for (o, _), r in self._held.items() if o == owner)

    def live(self) -> list[R]:
        """Every owner's live records."""
        now = self.clock()
        return [r for r in self._held.values() if r.is_live(now)]

    def hold(self, record: R) -> None:
        """Hold ``record`` under its key, in place of any record held there."""
        self._held[(record.owner, record.record_id)] = record

    def release(self, record: R) -> bool:
        """Stop holding ``record`` (its backend record stays); False if it was not the one held."""
        if not self.holds(record):
            return False
        del self._held[(record.owner, record.record_id)]
        return True

    def pop_expired(self) -> list[R]:
        """Drop and return every record that ``can_sweep`` now, with a local backend's record."""
        now = self.clock()
        expired = [r for r in self._held.values() if r.can_sweep(now)]
        for record in expired:
            del self._held[(record.owner, record.record_id)]
            if self.backend is not None and not self.backend.shared:
                try:
                    self.backend.delete(record.owner, record.record_id)
                except OSError:
                    logger.exception("could not delete the record of %s %s", self.noun, record.record_id)
        return expired

    # ------------------------------------------------------------------ backend writes

    def save(self, record: R) -> None:
        """Write the record (never one that is not ``written``); SessionNotDurable as ``write``."""
        backend = self.backend
        if backend is not None and record.written:
            self.write(f"{self.noun} '{record.record_id}'", lambda: backend.save(record.to_json()))

    def write(self, what: str, write: Callable[[], None]) -> None:
        """Run one backend write of ``what``: OSError is counted and raised as SessionNotDurable
        (the backend kept its old record); another failure is logged, not raised."""
        try:
            write()
        except OSError as exc:
            self.write_failures.record(exc)
            raise not_durable(what, exc) from exc
        except Exception:  # noqa: BLE001 - not a storage failure; a shared backend republishes
            logger.exception("could not persist %s", what)

    def delete_record(self, record: R) -> None:
        """Forget the record in the backend (a failure is logged: a shared record expires on its own)."""
        backend = self.backend
        if backend is not None:
            self.delete_quietly(f"{self.noun} {record.record_id}",
                                lambda: backend.delete(record.owner, record.record_id))

    @staticmethod
    def delete_quietly(what: str, delete: Callable[[], None]) -> None:
        """Run one backend deletion of ``what``, logging a failure."""
        try:
            delete()
        except Exception:  # noqa: BLE001 - gone here; a shared record expires on its own
            logger.exception("could not delete the record of %s", what)

    # ------------------------------------------------------------------ backend reads

    def parse(self, record: dict[str, Any] | None) -> R | None:
        """A backend record as a held one; None for no record or a corrupt one."""
        if record is None:
            return None
        try:
            return self._parse(record)
        except (KeyError, TypeError, ValueError):
            logger.exception("ignoring a corrupt %s record", self.noun)
            return None

    @property
    def rereads(self) -> bool:
        """Whether lookups read the backend again (a shared one: other replicas change it)."""
        return self.backend is not None and self.backend.shared

    def fetch(self, owner: str | None, record_id: str, lacks: Callable[[dict[str, Any] | None], bool]) -> BackendRead:
        """The shared backend's record, after a republish if one is wanted (blocking). ``lacks``:
        whether a record read lacks what is held here (then it may have been lost, see ``_read``)."""
        losses = self.losses
        self.republish_if_wanted()
        return self._read(owner, record_id, losses, lacks)

    async def afetch(self, owner: str | None, record_id: str,
                     lacks: Callable[[dict[str, Any] | None], bool]) -> BackendRead:
        """``fetch`` with the backend read on a worker thread, off the event loop."""
        losses = self.losses
        self.republish_if_wanted()
        return await asyncio.to_thread(self._read, owner, record_id, losses, lacks)

    def _read(self, owner: str | None, record_id: str, losses: int,
              lacks: Callable[[dict[str, Any] | None], bool]) -> BackendRead:
        """The backend's record, ``lost`` when it could not be read, or when it lacks what is held
        here and the backend lost its data (by its marker, or by a loss noted since ``losses``,
        which another check found first). Blocking: any thread."""
        assert self.backend is not None
        try:
            record = self.backend.load(owner, record_id)
        except Exception as exc:  # noqa: BLE001 - backend down: what this replica holds is the best it knows
            # Quiet while Redis is unreachable: its breaker has logged that once.
            logger.log(logging.DEBUG if isinstance(exc, RedisUnavailable) else logging.WARNING,
                       "could not read %s %s from its backend (%s: %s)",
                       self.noun, record_id, type(exc).__name__, exc)
            return BackendRead(None, True)
        if lacks(record) and (backend_lost_data(self.backend) or self.losses != losses):
            return BackendRead(None, True)
        return BackendRead(record, False)

    def _load_all(self) -> None:
        """Hold every readable record the backend hands out at start (none when it cannot be read)."""
        assert self.backend is not None
        try:
            records = self.backend.load_all()
        except Exception:  # noqa: BLE001 - unreadable records start empty rather than not at all
            logger.exception("could not load the %s records; starting with none", self.noun)
            return
        for parsed in map(self.parse, records):
            if parsed is not None:
                self.hold(parsed)

    # ------------------------------------------------------------------ republish

    def want_republish(self) -> None:
        """The shared backend may lack what this replica holds: republish before its next read.
        Safe from any thread (it only sets a flag and counts)."""
        self.losses += 1
        self._republish_wanted = True

    def republish_if_wanted(self) -> int:
        """Write every live record held here again, if the backend may lack them; how many."""
        wanted, self._republish_wanted = self._republish_wanted, False
        if not wanted or self.backend is None:
            return 0
        now = self.clock()
        live = [r for r in self._held.values() if r.is_live(now) and r.written]
        for record in live:
            try:
                self.backend.save(record.to_json())
            except Exception:  # noqa: BLE001 - the next recovery republishes again
                logger.exception("could not republish %s %s", self.noun, record.record_id)
        if live:
            logger.info("republished %d %s records to their backend", len(live), self.noun)
        return len(live)

    async def check_backend(self) -> None:
        """Ask a shared backend whether it lost its data (off the event loop); republish if so."""
        if self._held and await check_backend_data(self.backend):
            self.republish_if_wanted()
