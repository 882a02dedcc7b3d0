"""HTTP/1.1 connection limits of a replica and a gateway: the config, its flags and their bounds.

One frozen ``HttpLimits`` holds what a server allows a connection before a request reaches the app:
the size and field count of a request head, the time to send it, the idle time between requests,
and how many connections may be open at once. ``add_http_limit_args`` adds the same flags to
``kvhive serve`` and ``kvhive gateway``; ``kvhive.core.http_protocol`` enforces them.
"""

from __future__ import annotations

import argparse
import resource
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import NamedTuple

# The default connection cap: half the process's open-file limit (the other half stays for model
# files, disk-tier segments, Redis, ZMQ and, in a gateway, the connection to a replica behind each
# client connection), at most this many.
MAX_DEFAULT_CONNECTIONS = 4096


def default_max_connections() -> int:
    """Half of this process's soft open-file limit, at most MAX_DEFAULT_CONNECTIONS (at least 1)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_DEFAULT_CONNECTIONS
    return max(1, min(MAX_DEFAULT_CONNECTIONS, soft // 2))


class Bound(NamedTuple):
    """The flag that sets one ``HttpLimits`` field, its value type and range, and its help."""

    flag: str
    parse: Callable[[str], float]
    low: float
    high: float
    low_inclusive: bool
    metavar: str
    help: str

    def problem(self, value: float) -> str | None:
        """Why ``value`` is out of range (a message naming the flag), or None when it is within."""
        too_low = value < self.low if self.low_inclusive else value <= self.low
        if too_low or value > self.high or value != value:          # value != value: NaN
            low = "[" if self.low_inclusive else "("
            return f"{self.flag} must be in {low}{_number(self.low)}, {_number(self.high)}], got {_number(value)}"
        return None


def _number(value: float) -> str:
    """``value`` as a person writes it: 16777216, 0.5, 3600."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


BOUNDS: dict[str, Bound] = {
    "max_header_bytes": Bound(
        "--http-max-header-bytes", int, 1024, 16 * 2**20, True, "N",
        "largest request head in bytes (request line and header fields); a longer one is refused "
        "with 431 and the connection closed, once that many bytes have arrived"),
    "max_headers": Bound(
        "--http-max-headers", int, 1, 10_000, True, "N",
        "most header fields in a request; more are refused with 431"),
    "header_timeout_s": Bound(
        "--http-header-timeout", float, 0, 3600, False, "S",
        "seconds a client has to send a whole request head, from when its connection opens or, on a "
        "kept-alive connection, from the first byte of the next request; past it: 408 and the "
        "connection closed. A response, however long it streams, is not timed"),
    "keep_alive_timeout_s": Bound(
        "--http-keep-alive-timeout", float, 0, 3600, False, "S",
        "seconds an idle connection stays open after a response, waiting for the next request"),
    "max_connections": Bound(
        "--http-max-connections", int, 1, 2**20, True, "N",
        "most connections open at once; one over it is answered 503 with 'Connection: close' as "
        "soon as it opens (default: half the open-file limit, at most 4096: %(default)s here)"),
}


@dataclass(frozen=True)
class HttpLimits:
    """What a connection may send and hold before its request reaches the app (see BOUNDS)."""

    max_header_bytes: int = 64 * 1024
    max_headers: int = 100
    header_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 30.0
    max_connections: int = field(default_factory=default_max_connections)

    def __post_init__(self) -> None:
        for name, bound in BOUNDS.items():
            problem = bound.problem(getattr(self, name))
            if problem is not None:
                raise ValueError(problem)


def _flag_type(bound: Bound) -> Callable[[str], float]:
    """The argparse type of ``bound``'s flag: its number, range-checked (argparse exits 2 otherwise)."""

    def parse(text: str) -> float:
        try:
            value = bound.parse(text)
        except ValueError:
            kind = "a whole number" if bound.parse is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind}") from None
        problem = bound.problem(value)
        if problem is not None:
            raise argparse.ArgumentTypeError(problem.removeprefix(f"{bound.flag} "))
        return value

    return parse


def add_http_limit_args(p: argparse.ArgumentParser) -> None:
    """Add the "HTTP limits" group to ``p`` (``kvhive serve`` and ``kvhive gateway`` alike)."""
    g = p.add_argument_group("HTTP limits (per connection, before a request reaches the app)")
    defaults = HttpLimits()
    for f in fields(HttpLimits):
        bound = BOUNDS[f.name]
        g.add_argument(bound.flag, dest=http_dest(f.name), type=_flag_type(bound),
                       default=getattr(defaults, f.name), metavar=bound.metavar, help=bound.help)


def http_dest(name: str) -> str:
    """The argparse dest of ``HttpLimits`` field ``name`` (its flag without dashes)."""
    return BOUNDS[name].flag[2:].replace("-", "_")


def http_limits_from_args(args: argparse.Namespace) -> HttpLimits:
    """The validated ``HttpLimits`` of parsed flags (see ``add_http_limit_args``)."""
    return HttpLimits(**{f.name: getattr(args, http_dest(f.name)) for f in fields(HttpLimits)})
