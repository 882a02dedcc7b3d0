"""``kvhive serve --kv-events-config`` as a process: bad configs stop it at start (exit 2, naming the
problem), and a replica's stream, read the way llm-d reads it, starts with AllBlocksCleared at
sequence 0, carries its CPU tier's blocks, and starts again at 0 when the replica restarts."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

import pytest
import zmq
from support.kv_event_decoders import LlmdEvent, llmd_decode, receive, replay_from, subscribe
from support.kvhive_serve import ServeProcess
from support.servers import REPO_ROOT, free_port, subprocess_env

MODEL = "smollm2-135m"


@pytest.mark.parametrize("config,named", [
    ('{"enable_kv_cache_events": true, "topicFilter": "kv@"}', "unknown key 'topicFilter'"),
    ('{"enable_kv_cache_events": "true"}', "enable_kv_cache_events must be a boolean"),
    ('{"encoding": "protobuf"}', "encoding must be one of map, array, got 'protobuf'"),
    ('{"topic": "kv@{pod}@{model}"}', "topic placeholder {pod} is unknown"),
    ('{"hash_format": "sha256"}', "hash_format must be one of bytes, int64"),
    ("{enable_kv_cache_events: true}", "not valid JSON"),
])
def test_a_bad_kv_events_config_stops_serve_at_start(config: str, named: str) -> None:
    done = subprocess.run([sys.executable, "-m", "kvhive.cli", "serve", "--port", str(free_port()),
                           "--kv-events-config", config], capture_output=True, text=True, timeout=60,
                          cwd=REPO_ROOT, env=subprocess_env())
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("kvhive serve: --kv-events-config: "), done.stderr
    assert named in done.stderr


def test_the_short_form_and_the_config_cannot_both_give_the_endpoint() -> None:
    done = subprocess.run([sys.executable, "-m", "kvhive.cli", "serve", "--kv-events", "tcp://*:5557",
                           "--kv-events-config", '{"endpoint": "tcp://*:5558"}'], capture_output=True,
                          text=True, timeout=60, cwd=REPO_ROOT, env=subprocess_env())
    assert done.returncode == 2 and "give it once" in done.stderr, done.stderr


def events_of(messages: list[tuple[bytes, int, bytes]]) -> list[LlmdEvent]:
    return [event for topic, _, payload in messages for event in llmd_decode(topic, payload).events]


def test_llmd_reads_a_replica_that_restarts() -> None:
    events_port, replay_port = free_port(), free_port()
    config = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{events_port}",
                         "replay_endpoint": f"tcp://*:{replay_port}", "topic": "kv@{host}@{model}",
                         "encoding": "array", "hash_format": "int64"})
    flags = ("--kv-events-config", config, "--cpu-offload-gb", "0.05", "--kv-cache-gb", "0.2",
             "--max-model-len", "1024")
    replay = f"tcp://127.0.0.1:{replay_port}"
    ctx = zmq.Context()
    sub = subscribe(ctx, f"tcp://127.0.0.1:{events_port}", b"kv@")     # reconnects across restarts
    try:
        first = ServeProcess(*flags)
        try:
            (seq0, payload0), *_ = replay_from(ctx, replay, 0)
            assert seq0 == 0 and llmd_decode(b"kv@x@y", payload0).events == [LlmdEvent("AllBlocksCleared")]
            for i in range(3):
                first.complete(f"Story {i}: the quick brown fox jumps over the lazy dog. " * 8, max_tokens=2)
            messages = receive_until(sub, lambda got: got[-1][1] >= 8 and any(
                e.tier == "cpu" for e in events_of(got)))
            assert {(b.pod, b.model) for b in (llmd_decode(t, p) for t, _, p in messages)} == {("127.0.0.1", MODEL)}
            device = {h for e in events_of(messages) if e.kind == "BlockStored" and e.tier == "gpu" for h in e.hashes}
            cpu = [e for e in events_of(messages) if e.kind == "BlockStored" and e.tier == "cpu"]
            assert device and all(e.tokens == [] and set(e.hashes) <= device for e in cpu)
        finally:
            first.kill()
        while sub.poll(500):                          # what the first life sent and we did not read yet
            messages += receive(sub, 1)
        last_seq = messages[-1][1]
        second = ServeProcess(*flags)
        try:
            (seq0, payload0), *_ = replay_from(ctx, replay, 0)
            assert seq0 == 0 and llmd_decode(b"kv@x@y", payload0).events == [LlmdEvent("AllBlocksCleared")]
            second.complete("A different prompt about rivers and mountains, told twice. " * 6, max_tokens=2)
            (_, seq, _), = receive(sub, 1, timeout_s=30)
            assert seq < last_seq                     # the sequence started again (one request: a few batches)
        finally:
            second.stop()
    finally:
        sub.close()
        ctx.term()


Messages = list[tuple[bytes, int, bytes]]


def receive_until(sub: zmq.Socket, done: Callable[[Messages], bool], timeout_s: float = 60) -> Messages:
    """Messages until ``done`` holds for those received (the CPU tier's events follow a step)."""
    messages: Messages = []
    while not messages or not done(messages):
        messages += receive(sub, 1, timeout_s=timeout_s)
    return messages
