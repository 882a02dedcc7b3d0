"""The live page's data: what ``GET /dashboard/data`` answers on a replica and on the gateway.

Torch-free: ``kvhive serve`` and ``kvhive gateway`` both build a ``DashboardData`` and the one page
(``kvhive.core.dashboard_page``) renders any of them generically: cards as numbers, series as line
charts, tables as tables. ``StatsRing`` keeps the last minutes of samples for the series, bounded.
``DashboardAccess`` is who may open the page and read the data (``--no-dashboard``, the keys,
``--admin-key``): the key comes as Bearer, ``x-api-key`` or HTTP Basic's password, so a browser asks for it.
"""

from __future__ import annotations

import base64
import binascii
import secrets
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

# How often the series are sampled and how many samples are kept: 10 minutes at 5 s.
SAMPLE_INTERVAL_S = 5.0
SAMPLE_CAPACITY = 120
# How often the page asks for new data.
POLL_INTERVAL_S = 2.0
# Rows a table shows at most (the page says how many were left out).
MAX_TABLE_ROWS = 100

Cell = str | int | float | None


@dataclass(frozen=True)
class Card:
    """One number: ``id`` is stable (the page's ``data-card``), ``unit`` says how to read it."""

    id: str
    label: str
    value: float | int
    unit: str = ""

    def to_json(self) -> dict[str, Any]:
        """The card as the page reads it."""
        return {"id": self.id, "label": self.label, "value": self.value, "unit": self.unit}


@dataclass(frozen=True)
class Series:
    """A line over time: ``points`` are ``(unix_s, value)``, oldest first."""

    id: str
    label: str
    unit: str
    points: tuple[tuple[float, float], ...]

    def to_json(self) -> dict[str, Any]:
        """The series as the page reads it."""
        return {"id": self.id, "label": self.label, "unit": self.unit,
                "points": [[round(t, 3), v] for t, v in self.points]}


@dataclass(frozen=True)
class Table:
    """Rows of cells under named columns; ``omitted``: rows left out past MAX_TABLE_ROWS."""

    id: str
    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[Cell, ...], ...]
    omitted: int = 0

    def to_json(self) -> dict[str, Any]:
        """The table as the page reads it."""
        return {"id": self.id, "title": self.title, "columns": list(self.columns),
                "rows": [list(row) for row in self.rows], "omitted": self.omitted}


def bounded_table(id: str, title: str, columns: Sequence[str], rows: Sequence[Sequence[Cell]],
                  max_rows: int = MAX_TABLE_ROWS) -> Table:
    """A table of the first ``max_rows`` of ``rows``, counting the rest as omitted."""
    kept = tuple(tuple(row) for row in rows[:max_rows])
    return Table(id, title, tuple(columns), kept, max(0, len(rows) - max_rows))


@dataclass(frozen=True)
class DashboardData:
    """Everything one poll of the page shows."""

    title: str
    generated_at: float
    cards: tuple[Card, ...] = ()
    series: tuple[Series, ...] = ()
    tables: tuple[Table, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The JSON body of ``GET /dashboard/data``."""
        return {"title": self.title, "generated_at": round(self.generated_at, 3),
                "poll_interval_s": POLL_INTERVAL_S,
                "cards": [c.to_json() for c in self.cards], "series": [s.to_json() for s in self.series],
                "tables": [t.to_json() for t in self.tables]}


SampleT = TypeVar("SampleT")


class StatsRing(Generic[SampleT]):
    """The latest samples, at most ``capacity``, at least ``interval_s`` apart (memory is bounded
    whatever the polling rate: a sample offered sooner than ``interval_s`` after the last is dropped)."""

    def __init__(self, interval_s: float = SAMPLE_INTERVAL_S, capacity: int = SAMPLE_CAPACITY) -> None:
        if interval_s <= 0 or capacity < 2:
            raise ValueError(f"StatsRing needs interval_s > 0 and capacity >= 2, got {interval_s}, {capacity}")
        self.interval_s = interval_s
        self._samples: deque[tuple[float, SampleT]] = deque(maxlen=capacity)

    def offer(self, now: float, sample: SampleT) -> bool:
        """Keep ``sample`` taken at ``now`` (unix s) if the last kept one is ``interval_s`` old; says whether."""
        if self._samples and now - self._samples[-1][0] < self.interval_s:
            return False
        self._samples.append((now, sample))
        return True

    def due(self, now: float) -> bool:
        """Whether a sample offered at ``now`` would be kept."""
        return not self._samples or now - self._samples[-1][0] >= self.interval_s

    def samples(self) -> list[tuple[float, SampleT]]:
        """The kept samples, oldest first."""
        return list(self._samples)


def rate_points(samples: Sequence[tuple[float, tuple[float, float]]]) -> tuple[tuple[float, float], ...]:
    """Per interval between consecutive samples of cumulative ``(hits, queries)``: hits / queries
    (0 where nothing was asked), stamped at the interval's end."""
    points = []
    for (_, (hits0, queries0)), (t1, (hits1, queries1)) in zip(samples, samples[1:], strict=False):
        asked = queries1 - queries0
        points.append((t1, round((hits1 - hits0) / asked, 4) if asked > 0 else 0.0))
    return tuple(points)


# Longest Authorization or x-api-key header the page reads a key from; a longer one presents no key.
MAX_KEY_HEADER_CHARS = 4096
# What a 401 from the page or its data asks for: a browser then prompts for the key (any user name).
DASHBOARD_CHALLENGE = 'Basic realm="kvhive dashboard", charset="UTF-8"'
MISSING_KEY_MESSAGE = ("Invalid or missing API key. Send 'Authorization: Bearer <key>', 'x-api-key: <key>' "
                       "or HTTP Basic auth with the key as the password.")


def basic_password(credentials: str) -> bytes | None:
    """The password of HTTP Basic ``credentials`` (base64 of ``user:password``), else None."""
    try:
        decoded = base64.b64decode(credentials.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    _, colon, password = decoded.partition(b":")
    return password if colon else None


def presented_dashboard_key(authorization: str | None, x_api_key: str | None = None) -> bytes | None:
    """The key a dashboard request presents, as bytes: Bearer's token, Basic's password, else
    ``x-api-key`` when no Authorization is sent; None for none, an empty one, another scheme or a
    header over MAX_KEY_HEADER_CHARS."""
    header = authorization or x_api_key
    if not header or len(header) > MAX_KEY_HEADER_CHARS:
        return None
    if not authorization:
        return header.strip().encode("utf-8", "replace") or None
    scheme, _, credentials = header.strip().partition(" ")
    if scheme.lower() == "bearer":
        return credentials.strip().encode("utf-8", "replace") or None
    return (basic_password(credentials) or None) if scheme.lower() == "basic" else None


@dataclass(frozen=True)
class DashboardAccess:
    """Whether the page is served and who may read its data: ``api_keys`` (empty: anyone, unless
    ``admin_key`` is set, then only it), ``admin_key`` sees every key's sessions and usage."""

    enabled: bool = True
    api_keys: tuple[str, ...] = ()
    admin_key: str | None = None

    @property
    def needs_key(self) -> bool:
        """Whether the page and its data answer 401 (``DASHBOARD_CHALLENGE``) to a request without a valid key."""
        return bool(self.api_keys) or self.admin_key is not None

    def key_of(self, authorization: str | None, x_api_key: str | None = None) -> str | None:
        """The valid key the request presents (``Authorization: Bearer KEY``, ``Authorization: Basic``
        whose password is the key, or ``x-api-key: KEY``), else None. Never raises."""
        token = presented_dashboard_key(authorization, x_api_key)
        if token is None:
            return None
        keys = (*self.api_keys, *(() if self.admin_key is None else (self.admin_key,)))
        # compare_digest against every key: the time taken does not reveal which key nearly matched.
        matches = [key for key in keys if secrets.compare_digest(token, key.encode())]
        return matches[0] if matches else None

    def key_in(self, headers: Mapping[str, str]) -> str | None:
        """``key_of`` a request's headers (``headers.get`` finds a header by its lower-case name)."""
        return self.key_of(headers.get("authorization"), headers.get("x-api-key"))

    def is_admin(self, key: str | None) -> bool:
        """Whether ``key`` (a valid key, from ``key_of``) is the admin key."""
        return key is not None and self.admin_key is not None and secrets.compare_digest(
            key.encode(), self.admin_key.encode())


# The page served, its data open to anyone (a server or gateway without keys).
OPEN_DASHBOARD = DashboardAccess()
