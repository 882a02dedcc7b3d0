"""``--kv-events-config``: where and how a replica publishes KV events, in vLLM's field names.

The JSON object takes vLLM's ``KVEventsConfig`` keys (``vllm/config/kv_events.py``):
``enable_kv_cache_events``, ``publisher`` ("zmq" or "null"), ``endpoint``, ``replay_endpoint``,
``buffer_steps``, ``hwm``, ``max_queue_size``, ``topic``; and kvhive's own:

- ``encoding``: ``map`` (the default; vLLM's current structs: a batch map ``{"ts", "events",
  "data_parallel_rank"}``, each event a map tagged ``"type"``) or ``array`` (vLLM's positional
  ``array_like`` structs, which llm-d's vLLM adapter decodes).
- ``hash_format``: ``bytes`` (the default: kvhive's 16-byte block digests) or ``int64``: vLLM's
  int form of a hash (``maybe_convert_block_hash``: the digest read as a big-endian integer, kept
  to its low 64 bits, so the digest's last 8 bytes as an unsigned 64-bit number). llm-d reads a
  bytes hash the same way (its last 8 bytes, big-endian), so both formats name a block alike there.
- ``data_parallel_rank``: stamped on every batch (default 0, as vLLM's publisher does).
- ``priority_events``: also send ``BlockUpdated`` when a device block's retention priority changes
  (default false: vLLM's and llm-d's decoders refuse a batch with an event type they do not know).

``topic`` is a template: ``{host}`` (the address the replica is reached at), ``{port}`` (its HTTP
port), ``{model}`` (the served model name) and ``{rank}`` (``data_parallel_rank``); ``{{``/``}}``
are literal braces. llm-d's precise-prefix-cache scorer reads pod and model from
``kv@{host}@{model}``. Events flow only with ``enable_kv_cache_events: true`` and the ``zmq``
publisher (vLLM's rule). Any other key, a wrong type, an unknown value or placeholder is a
``ValueError`` that names it.
"""

from __future__ import annotations

import json
import socket
import string
from dataclasses import dataclass, fields, replace
from typing import Any

from kvhive.core.flag_values import json_flag_object

ENCODINGS = ("map", "array")
HASH_FORMATS = ("bytes", "int64")
PUBLISHERS = ("zmq", "null")
TOPIC_FIELDS = ("host", "port", "model", "rank")
ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")
MAX_TOPIC_CHARS = 1024
MAX_BUFFER = 10_000_000                 # bound of buffer_steps, hwm and max_queue_size
OPTION = "--kv-events-config"


@dataclass(frozen=True)
class KVEventsConfig:
    """How the engine publishes KV events; ``host`` and ``port`` fill the topic's placeholders."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None           # None: "zmq" when events are enabled, else "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    encoding: str = "map"
    hash_format: str = "bytes"
    data_parallel_rank: int = 0
    priority_events: bool = False
    # Not JSON keys: the server sets them (the address its clients reach, its HTTP port).
    host: str = "127.0.0.1"
    port: int = 8000

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_type(f.name, getattr(self, f.name))
        _check_choice("publisher", self.publisher, PUBLISHERS, optional=True)
        _check_choice("encoding", self.encoding, ENCODINGS)
        _check_choice("hash_format", self.hash_format, HASH_FORMATS)
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(ENDPOINT_SCHEMES):
                raise ValueError(f"{OPTION}: {name} must be a ZMQ endpoint ({', '.join(ENDPOINT_SCHEMES)}), "
                                 f"got {value!r}")
        for name, low in (("buffer_steps", 0), ("hwm", 0), ("max_queue_size", 1)):
            if not low <= getattr(self, name) <= MAX_BUFFER:
                raise ValueError(f"{OPTION}: {name} must be in [{low}, {MAX_BUFFER}], got {getattr(self, name)}")
        if not 0 <= self.data_parallel_rank < 2**16:
            raise ValueError(f"{OPTION}: data_parallel_rank must be in [0, 65535], got {self.data_parallel_rank}")
        if len(self.topic) > MAX_TOPIC_CHARS:
            raise ValueError(f"{OPTION}: topic is longer than {MAX_TOPIC_CHARS} characters")
        topic_placeholders(self.topic)

    @property
    def active(self) -> bool:
        """Whether the engine publishes anything: events enabled on the ZMQ publisher."""
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"

    @property
    def as_map(self) -> bool:
        """True for the map encoding, False for positional arrays."""
        return self.encoding == "map"

    @property
    def int_hashes(self) -> bool:
        """True when hashes go on the wire as vLLM's 64-bit ints."""
        return self.hash_format == "int64"

    def rendered_topic(self, model: str) -> str:
        """The topic with its placeholders filled for this replica serving ``model``."""
        return self.topic.format(host=self.host, port=self.port, model=model, rank=self.data_parallel_rank)

    def for_server(self, host: str, port: int) -> KVEventsConfig:
        """This config with the address clients reach the replica at (``{host}``) and its port."""
        return replace(self, host=advertised_host(host) if "host" in topic_placeholders(self.topic) else host,
                       port=port)


def _check_type(name: str, value: Any) -> None:
    """ValueError naming ``name`` when ``value`` is not of the field's JSON type."""
    kinds = {"enable_kv_cache_events": (bool,), "priority_events": (bool,), "publisher": (str, type(None)), "replay_endpoint": (str, type(None))}
    ints = ("buffer_steps", "hwm", "max_queue_size", "data_parallel_rank", "port")
    if name in ints:
        ok = isinstance(value, int) and not isinstance(value, bool)
        wanted = "an integer"
    else:
        expected = kinds.get(name, (str,))
        ok = isinstance(value, expected)
        wanted = " or ".join("null" if k is type(None) else {"bool": "a boolean", "str": "a string"}[k.__name__]
                             for k in expected)
    if not ok:
        raise ValueError(f"{OPTION}: {name} must be {wanted}, got {json.dumps(value, default=repr)}")


def _check_choice(name: str, value: str | None, choices: tuple[str, ...], optional: bool = False) -> None:
    if (value is None and optional) or value in choices:
        return
    raise ValueError(f"{OPTION}: {name} must be one of {', '.join(choices)}, got {value!r}")


def topic_placeholders(template: str) -> set[str]:
    """The placeholders ``template`` uses; ValueError naming one that is not in TOPIC_FIELDS."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"{OPTION}: topic {template!r} is not a valid template ({exc}); "
                         "write a literal brace as {{ or }}") from None
    used = set()
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if name not in TOPIC_FIELDS or spec or conversion:
            shown = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
            raise ValueError(f"{OPTION}: topic placeholder {shown} is unknown "
                             f"(known: {', '.join('{' + f + '}' for f in TOPIC_FIELDS)})")
        used.add(name)
    return used


def advertised_host(listen_host: str) -> str:
    """The address others reach this replica at: ``listen_host`` unless it is a wildcard, else this
    machine's address by its host name (a Kubernetes pod's IP), else the host name itself."""
    if listen_host not in ("", "0.0.0.0", "::", "[::]"):
        return listen_host
    name = socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError:
        return name


JSON_KEYS = tuple(f.name for f in fields(KVEventsConfig) if f.name not in ("host", "port"))


def parse_kv_events_config(text: str | None, endpoint: str | None = None,
                           replay_endpoint: str | None = None) -> KVEventsConfig | None:
    """The config from ``--kv-events-config`` JSON and the short forms ``--kv-events ENDPOINT``
    (events on, at that endpoint) and ``--kv-events-replay ENDPOINT``; None when none is given."""
    if text is None and endpoint is None and replay_endpoint is None:
        return None
    values: dict[str, Any] = {}
    if text is not None:
        values = json_flag_object(OPTION, text)
        unknown = sorted(set(values) - set(JSON_KEYS))
        if unknown:
            raise ValueError(f"{OPTION}: unknown key {unknown[0]!r} (known: {', '.join(JSON_KEYS)})")
    for flag, key, value in (("--kv-events", "endpoint", endpoint),
                             ("--kv-events-replay", "replay_endpoint", replay_endpoint)):
        if value is None:
            continue
        if key in values:
            raise ValueError(f"{flag} and {OPTION}'s {key} both give the {key}: give it once")
        values[key] = value
    if endpoint is not None:
        values.setdefault("enable_kv_cache_events", True)
    if replay_endpoint is not None and endpoint is None and text is None:
        raise ValueError("--kv-events-replay needs --kv-events (or an endpoint in --kv-events-config)")
    return KVEventsConfig(**values)
