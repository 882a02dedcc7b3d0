"""KV-event decoders written from other systems' definitions, never from kvhive's own decoder.

- ``vllm_batch_type(array_like)``: vLLM's msgspec structs (``vllm/distributed/kv_events.py``):
  ``KVCacheEvent`` is a tagged union (``tag=True``: the tag is the class name under ``"type"``),
  ``omit_defaults=True``; the current structs encode maps, the older ones ``array_like=True``
  positional arrays. Decoding with ``msgspec.msgpack.Decoder(type)`` is exactly what a vLLM-side
  consumer does.
- ``llmd_decode``: llm-d's subscriber (``pkg/kvevents/engineadapter``): the topic
  ``kv@<pod>@<model>`` split on ``@``, a positional-array batch, each hash turned into a uint64
  (an int as it is, a bytes hash by its last 8 bytes, big-endian), the medium lower-cased ("gpu"
  when absent), a nil parent read as 0.
- ``subscribe`` / ``replay_from`` / ``receive``: the ZMQ side, as any subscriber does it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
UINT64 = (1 << 64) - 1


def vllm_batch_type(array_like: bool) -> type:
    """vLLM's ``KVEventBatch`` struct: maps (current) or positional arrays (``array_like``). Built
    with ``msgspec.defstruct`` (real types, not string annotations), field for field as vLLM declares
    them."""
    import msgspec

    options = {"array_like": array_like, "omit_defaults": True, "gc": False}
    wire_hash = bytes | int
    event = msgspec.defstruct("KVCacheEvent", [], tag=True, **options)
    stored = msgspec.defstruct("BlockStored", [
        ("block_hashes", list[wire_hash]), ("parent_block_hash", wire_hash | None),
        ("token_ids", list[int]), ("block_size", int), ("lora_id", int | None), ("medium", str | None),
        ("lora_name", str | None), ("extra_keys", list[tuple[Any, ...] | None] | None, None),
        ("group_idx", int | None, None), ("kv_cache_spec_kind", str | None, None),
        ("kv_cache_spec_sliding_window", int | None, None)], bases=(event,), tag=True, **options)
    removed = msgspec.defstruct("BlockRemoved", [
        ("block_hashes", list[wire_hash]), ("medium", str | None), ("group_idx", int | None, None)],
        bases=(event,), tag=True, **options)
    cleared = msgspec.defstruct("AllBlocksCleared", [], bases=(event,), tag=True, **options)
    return msgspec.defstruct("KVEventBatch", [
        ("ts", float), ("events", list[stored | removed | cleared]), ("data_parallel_rank", int | None, None)],
        **options)


def vllm_decode(payload: bytes, array_like: bool) -> Any:
    """The batch as vLLM's structs decode it (msgspec.ValidationError when the layout differs)."""
    import msgspec

    return msgspec.msgpack.Decoder(vllm_batch_type(array_like)).decode(payload)


@dataclass
class LlmdEvent:
    """One event as llm-d's vLLM adapter reads it."""

    kind: str
    hashes: list[int] = field(default_factory=list)
    parent: int = 0
    tokens: list[int] = field(default_factory=list)
    block_size: int = 0
    tier: str = "gpu"


@dataclass
class LlmdBatch:
    """A message as llm-d's pool sees it: the pod and model from the topic, and the events."""

    pod: str
    model: str
    ts: float
    events: list[LlmdEvent]


def llmd_parse_topic(topic: str) -> tuple[str, str]:
    """(pod, model) from ``kv@<pod>@<model>``; any other topic is the pod, with no model."""
    parts = topic.split("@")
    return (parts[1], parts[2]) if len(parts) == 3 else (topic, "")


def llmd_hash(raw: Any) -> int:
    """A block hash as llm-d keys it: uint64 (ints as they are, bytes by their last 8 bytes)."""
    if isinstance(raw, int):
        return raw & UINT64
    if isinstance(raw, bytes) and raw:
        return int.from_bytes(raw[-8:].rjust(8, b"\0"), "big")
    raise ValueError(f"unsupported hash type: {type(raw).__name__}")


def llmd_decode(topic: bytes, payload: bytes) -> LlmdBatch:
    """Decode one message the way llm-d's vLLM adapter does; ValueError where it would fail."""
    pod, model = llmd_parse_topic(topic.decode())
    body = msgpack.unpackb(payload, raw=False)
    if not isinstance(body, list) or len(body) < 2:
        raise ValueError("failed to decode vLLM event batch: not an array")
    events = []
    for raw in body[1]:
        if not isinstance(raw, list) or not raw or not isinstance(raw[0], str):
            raise ValueError("failed to decode tagged union")
        events.append(_llmd_event(raw))
    return LlmdBatch(pod, model, float(body[0]), events)


def _llmd_event(fields: list[Any]) -> LlmdEvent:
    def at(i: int) -> Any:
        return fields[i] if i < len(fields) else None

    tag = fields[0]
    if tag == "BlockStored":
        if len(fields) < 5:
            raise ValueError("BlockStored: need at least 5 fields")
        return LlmdEvent(tag, [llmd_hash(h) for h in fields[1]], 0 if fields[2] is None else llmd_hash(fields[2]),
                         list(fields[3]), int(fields[4]), (at(6) or "gpu").lower())
    if tag == "BlockRemoved":
        return LlmdEvent(tag, [llmd_hash(h) for h in fields[1]], tier=(at(2) or "gpu").lower())
    if tag == "AllBlocksCleared":
        return LlmdEvent(tag)
    raise ValueError(f"unknown vLLM event tag: {tag}")


def subscribe(ctx: zmq.Context, endpoint: str, topic_filter: bytes) -> zmq.Socket:
    """A SUB socket connected to ``endpoint`` with ``topic_filter`` (llm-d uses b"kv@")."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic_filter)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    return sub


def receive(sub: zmq.Socket, count: int, timeout_s: float = 10.0) -> list[tuple[bytes, int, bytes]]:
    """``count`` messages as (topic, sequence, payload); AssertionError if they do not come."""
    out = []
    deadline = time.monotonic() + timeout_s
    while len(out) < count:
        assert sub.poll(max(1, int((deadline - time.monotonic()) * 1000))), f"got {len(out)} of {count} messages"
        topic, seq, payload = sub.recv_multipart()
        out.append((topic, int.from_bytes(seq, "big"), payload))
    return out


def replay_from(ctx: zmq.Context, endpoint: str, start: int, timeout_s: float = 5.0) -> list[tuple[int, bytes]]:
    """vLLM's replay protocol as a client: [b"", start] in, [b"", seq, payload]... then seq -1 out."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert dealer.poll(int(timeout_s * 1000)), "replay did not answer"
            _, seq, payload = dealer.recv_multipart()
            if seq == END_OF_REPLAY:
                return out
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close()
