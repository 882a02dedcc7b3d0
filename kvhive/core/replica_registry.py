"""The replica registry in Redis: what ``kvhive serve --register`` writes and ``kvhive gateway
--discover`` reads (torch-free, dependency-free; both sides import it, so they agree on the layout).

Layout (one Redis database; the keys are namespaced like the rest of kvhive's):

- ``kvhive:replicas``: a set of replica URLs (members, added by each heartbeat).
- ``kvhive:replica:<url>``: that replica's ``ReplicaRecord`` as JSON, written with an expiry of
  ``ttl_s`` (Redis's own clock) on every heartbeat, every ``ttl_s / 3``.

A record that expired means the replica stopped beating (killed, hung, cut off). A record marked
``leaving`` means it shut down cleanly. A member whose record is gone is removed by the gateways.
"""

from __future__ import annotations

import json
import socket
from dataclasses import asdict, dataclass, fields
from urllib.parse import urlsplit

MEMBERS_KEY = "kvhive:replicas"
RECORD_KEY_PREFIX = "kvhive:replica:"
DEFAULT_REGISTER_TTL_S = 10.0
MIN_REGISTER_TTL_S = 1.0
MAX_REGISTER_TTL_S = 86400
_WILDCARD_HOSTS = ("", "*", "0.0.0.0", "::", "[::]")
_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
_MAX_RECORD_BYTES = 4096


def record_key(url: str) -> str:
    """The Redis key of the record of the replica at ``url``."""
    return RECORD_KEY_PREFIX + url


@dataclass(frozen=True)
class ReplicaRecord:
    """One registered replica: where it serves HTTP and publishes KV events, its model fingerprint,
    and how long its record lives without a heartbeat."""

    url: str
    events: str | None = None
    replay: str | None = None
    fingerprint: str = ""
    ttl_s: float = DEFAULT_REGISTER_TTL_S
    leaving: bool = False

    def encode(self) -> bytes:
        """The record as the JSON stored in Redis."""
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> ReplicaRecord | None:
        """A stored record, or None for one that is not a record (too large, not JSON, wrong
        fields or types): a gateway skips it."""
        if len(raw) > _MAX_RECORD_BYTES:
            return None
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return None
        if not isinstance(data, dict) or not isinstance(data.get("url"), str):
            return None
        known = {f.name for f in fields(cls)}     # fields a newer replica adds are ignored
        try:
            record = cls(**{k: v for k, v in data.items() if k in known})
        except TypeError:
            return None
        typed = (all(isinstance(v, str | None) for v in (record.events, record.replay))
                 and isinstance(record.fingerprint, str) and isinstance(record.leaving, bool)
                 and isinstance(record.ttl_s, int | float) and not isinstance(record.ttl_s, bool))
        return record if typed and record.url.startswith(("http://", "https://")) else None


@dataclass(frozen=True)
class RegistrationConfig:
    """``kvhive serve --register``: the registry's Redis URL, the URL gateways reach this replica
    at, and the record's TTL (a heartbeat every ``ttl_s / 3``). Validated once; ``ValueError``
    names the flag."""

    redis_url: str
    advertise_url: str
    ttl_s: float = DEFAULT_REGISTER_TTL_S

    def __post_init__(self) -> None:
        if not self.redis_url.startswith(_REDIS_SCHEMES):
            raise ValueError(f"--register must be a redis:// URL, got {self.redis_url!r}")
        parts = urlsplit(self.advertise_url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
            raise ValueError(f"--advertise-url must be http(s)://HOST:PORT, got {self.advertise_url!r}")
        if not MIN_REGISTER_TTL_S <= self.ttl_s <= MAX_REGISTER_TTL_S:
            raise ValueError(f"--register-ttl must be in [{MIN_REGISTER_TTL_S:g}, {MAX_REGISTER_TTL_S}] seconds, "
                             f"got {self.ttl_s}")

    @property
    def heartbeat_s(self) -> float:
        """Seconds between two heartbeats: a third of the TTL, so one late beat never expires it."""
        return self.ttl_s / 3

    def record(self, events: str | None, replay: str | None, fingerprint: str) -> ReplicaRecord:
        """This replica's record, with its event sockets' bind addresses turned into ones a gateway
        can connect to (a wildcard host becomes the advertised host)."""
        host = urlsplit(self.advertise_url).hostname or ""
        return ReplicaRecord(self.advertise_url.rstrip("/"), connectable(events, host),
                             connectable(replay, host), fingerprint, self.ttl_s)


def default_advertise_url(host: str, port: int) -> str:
    """The URL a replica listening on ``host``:``port`` advertises when --advertise-url is not
    given: its --host, or this machine's host name when it listens on every interface."""
    name = socket.gethostname() if host in _WILDCARD_HOSTS else host
    if ":" in name and not name.startswith("["):
        name = f"[{name}]"
    return f"http://{name}:{port}"


def connectable(endpoint: str | None, host: str) -> str | None:
    """A ZMQ bind endpoint as one a remote subscriber connects to: ``tcp://*:5557`` (or
    ``0.0.0.0``, ``[::]``) becomes ``tcp://HOST:5557``; other endpoints are kept as they are."""
    if endpoint is None or not endpoint.startswith("tcp://"):
        return endpoint
    address = endpoint[len("tcp://"):]
    bound, sep, port = address.rpartition(":")
    if not sep or bound not in _WILDCARD_HOSTS:
        return endpoint
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"
