"""KV events in vLLM's wire format: the event types, their batch, and its msgpack encoding and decoding
(torch-free; the engine publishes them with ``kvhive.kv.event_publisher``, the routing library reads them).

Wire format (vLLM's ``vllm/distributed/kv_events.py``):

    frames      topic | sequence (8-byte big-endian) | payload (msgpack EventBatch)
    EventBatch  array [ts, events, data_parallel_rank?]   or map {"ts", "events", "data_parallel_rank"?}
    event       array [tag, field, ...] in field order    or map {"type": tag, field: value, ...}
    replay      ROUTER socket: a client sends [b"", start seq (8 bytes big-endian)] and gets
                [b"", seq, payload] for each buffered batch with seq >= start, then
                [b"", -1 (8 bytes big-endian, signed), b""].

Older vLLM encodes arrays (msgspec ``array_like=True``), newer vLLM encodes maps; ``decode_batch``
reads both. Extra trailing array elements and unknown map keys are ignored (newer vLLM appends
fields), and events with an unknown tag are skipped. Block hashes are bytes (kvhive's 16-byte
digests) or ints (vLLM); both decode unchanged. The map encoding leaves out ``extra_keys`` when it
is None and ``data_parallel_rank`` when unset, as msgspec's ``omit_defaults`` does; the array
encoding keeps every field in place.

``BlockUpdated`` (kvhive's, after TensorRT-LLM's ``KVCacheUpdatedData``: a block's retention
priority changed, old and new value) is sent only when ``--kv-events-config`` sets
``priority_events``: vLLM's msgspec decoders and llm-d's adapter refuse a batch holding an event
tag they do not know, while kvhive's own decoder skips it.

Hashes on the wire (``int_hashes``): kvhive's digests as they are, or vLLM's int form of them
(``wire_int_hash``: the digest read big-endian, kept to its low 64 bits).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import msgpack

WireHash = bytes | int
# Tiers, fastest first. vLLM sends None for its device pool (older versions) and "GPU"/"CPU" by name.
MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK, MEDIUM_REMOTE = "GPU", "CPU", "DISK", "REMOTE"
MEDIA = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK, MEDIUM_REMOTE)
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


def normalize_medium(medium: str | None) -> str:
    """A tier name from MEDIA: None is the device pool; unknown names count as REMOTE (the slowest)."""
    if medium is None:
        return MEDIUM_GPU
    name = medium.upper()
    return name if name in MEDIA else MEDIUM_REMOTE


@dataclass(frozen=True)
class BlockStored:
    """Full blocks a replica now holds in ``medium``; ``token_ids`` are all the blocks' tokens."""

    block_hashes: list[WireHash]
    parent_block_hash: WireHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    # vLLM's per-block extra hash keys, one entry (a list, or None) per block hash, untagged: the LoRA
    # name, (multimodal id, offset) pairs, the cache salt (block 0 only), prompt-embedding digests.
    # kvhive's own events leave it None: their salt is already in their hashes.
    extra_keys: list[Any] | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks a replica no longer holds in ``medium``."""

    block_hashes: list[WireHash]
    medium: str | None = MEDIUM_GPU


@dataclass(frozen=True)
class BlockUpdated:
    """Blocks a replica holds in ``medium`` changed retention priority from ``old_priority`` to
    ``priority`` (evicted lowest priority first; ``kvhive.core.retention``)."""

    block_hashes: list[WireHash]
    priority: int
    old_priority: int | None = None
    medium: str | None = MEDIUM_GPU


@dataclass(frozen=True)
class AllBlocksCleared:
    """The replica dropped every block (cache reset or restart)."""


KVEvent = BlockStored | BlockRemoved | BlockUpdated | AllBlocksCleared
_EVENT_TYPES: dict[str, type] = {t.__name__: t for t in (BlockStored, BlockRemoved, BlockUpdated, AllBlocksCleared)}
# Wire field order of each event (dataclass field order is the wire contract: append only).
_FIELDS = {name: tuple(f.name for f in fields(t)) for name, t in _EVENT_TYPES.items()}
_REQUIRED = {"BlockStored": 4, "BlockRemoved": 1, "BlockUpdated": 2, "AllBlocksCleared": 0}


@dataclass(frozen=True)
class EventBatch:
    """Events of one engine step, in order; ``ts`` is the wall-clock time they were published."""

    ts: float
    events: list[KVEvent] = field(default_factory=list)
    data_parallel_rank: int | None = None


def wire_int_hash(block_hash: WireHash) -> int:
    """vLLM's int form of a block hash: the digest as a big-endian integer, low 64 bits (ints stay)."""
    if isinstance(block_hash, int):
        return block_hash
    return int.from_bytes(block_hash[-8:], "big")


def _event_values(event: KVEvent, int_hashes: bool) -> list[Any]:
    """The event's wire values in field order, hashes converted when ``int_hashes``."""
    tag = type(event).__name__
    values = [getattr(event, name) for name in _FIELDS[tag]]
    if int_hashes and values:           # block_hashes first, then (BlockStored) the parent
        values[0] = [wire_int_hash(h) for h in values[0]]
        if tag == "BlockStored" and values[1] is not None:
            values[1] = wire_int_hash(values[1])
    return values


def encode_batch(batch: EventBatch, as_map: bool = True, int_hashes: bool = False) -> bytes:
    """msgpack payload of ``batch`` as vLLM encodes it: maps with a "type" tag, or positional arrays."""
    events: list[Any] = []
    for event in batch.events:
        tag = type(event).__name__
        values = _event_values(event, int_hashes)
        if as_map:
            fields_map = dict(zip(_FIELDS[tag], values, strict=True))
            if fields_map.get("extra_keys", 0) is None:
                del fields_map["extra_keys"]            # a default: omitted, as omit_defaults does
            events.append({"type": tag, **fields_map})
        else:
            events.append([tag, *values])
    if as_map:
        body: Any = {"ts": batch.ts, "events": events}
        if batch.data_parallel_rank is not None:
            body["data_parallel_rank"] = batch.data_parallel_rank
    else:
        body = [batch.ts, events]
        if batch.data_parallel_rank is not None:
            body.append(batch.data_parallel_rank)
    return msgpack.packb(body, use_bin_type=True)


def decode_batch(payload: bytes) -> EventBatch:
    """An EventBatch from either encoding; raises ValueError on a payload that is neither."""
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (msgpack.UnpackException, ValueError) as exc:
        raise ValueError(f"KV event payload is not msgpack: {exc}") from exc
    if isinstance(body, dict):
        ts, raw_events, rank = body.get("ts"), body.get("events"), body.get("data_parallel_rank")
    elif isinstance(body, list) and len(body) >= 2:
        ts, raw_events, rank = body[0], body[1], body[2] if len(body) > 2 else None
    else:
        raise ValueError(f"KV event batch must be an array or a map, got {type(body).__name__}")
    if not isinstance(ts, int | float) or not isinstance(raw_events, list):
        raise ValueError("KV event batch needs a numeric 'ts' and a list of 'events'")
    events = [e for e in (_decode_event(raw) for raw in raw_events) if e is not None]
    return EventBatch(float(ts), events, rank if isinstance(rank, int) else None)


def _decode_event(raw: Any) -> KVEvent | None:
    if isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str) or tag not in _EVENT_TYPES:
            return None
        values = {k: raw[k] for k in _FIELDS[tag] if k in raw}
    elif isinstance(raw, list) and raw:
        tag = raw[0]
        if not isinstance(tag, str) or tag not in _EVENT_TYPES:
            return None
        values = dict(zip(_FIELDS[tag], raw[1:], strict=False))  # extra trailing fields ignored
    else:
        raise ValueError(f"KV event must be an array or a map, got {type(raw).__name__}")
    missing = [k for k in _FIELDS[tag][:_REQUIRED[tag]] if k not in values]
    if missing:
        raise ValueError(f"{tag} event lacks {', '.join(missing)}")
    for name, kind in (("block_hashes", list), ("token_ids", list), ("block_size", int), ("priority", int)):
        if name in values and not isinstance(values[name], kind):
            raise ValueError(f"{tag}.{name} must be a {kind.__name__}, got {type(values[name]).__name__}")
    if values.get("extra_keys") is not None and not isinstance(values["extra_keys"], list):
        raise ValueError(f"{tag}.extra_keys must be a list or nil, got {type(values['extra_keys']).__name__}")
    return _EVENT_TYPES[tag](**values)
