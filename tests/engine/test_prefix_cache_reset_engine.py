"""A prefix-cache reset in the engine (tiny random model): a repeated prompt is computed again with the
same greedy tokens, a running request and a session keep their blocks, and the KV-event stream,
applied in order, ends with exactly the blocks the pool holds."""

from __future__ import annotations

import time

import zmq
from support.engines import GREEDY, make_engine, run, turn
from support.kv_event_decoders import replay_from
from support.servers import free_port

from kvhive.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch

PROMPT = list(range(5, 30))
SESSION_PROMPT = list(range(60, 83))


def test_a_repeated_prompt_is_computed_again_with_the_same_tokens(tokenizer) -> None:
    engine = make_engine(tokenizer)
    first, _ = run(engine, {"a": PROMPT})["a"]
    again, cached = run(engine, {"b": PROMPT})["b"]
    assert cached == 24 and again == first
    reset = engine.reset_prefix_cache()
    assert reset.dropped["device"] >= 6 and reset.kept == {"device": 0}
    engine.scheduler.kv.pool.check_integrity()
    after, cached = run(engine, {"c": PROMPT})["c"]
    assert cached == 0 and after == first
    engine.close()


def device_view(batches: list[bytes]) -> set[bytes]:
    """The device blocks a consumer holds after applying ``batches`` in order."""
    held: set[bytes] = set()
    for payload in batches:
        for event in decode_batch(payload).events:
            if isinstance(event, AllBlocksCleared):
                held.clear()
            elif isinstance(event, BlockStored) and event.medium == "GPU":
                held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved) and event.medium == "GPU":
                held.difference_update(event.block_hashes)
    return held


def published(ctx: zmq.Context, replay: str, count: int) -> list[bytes]:
    """The stream from sequence 0 once it has at least ``count`` batches (the publisher's thread
    sends what the engine queued)."""
    deadline = time.monotonic() + 10
    while True:
        batches = [payload for _, payload in replay_from(ctx, replay, 0)]
        if len(batches) >= count or time.monotonic() > deadline:
            return batches
        time.sleep(0.02)


def test_running_requests_and_sessions_keep_their_blocks_and_the_stream_says_so(tokenizer) -> None:
    events, replay = free_port(), free_port()
    engine = make_engine(tokenizer, kv_events=f"tcp://*:{events}",
                         kv_events_replay=f"tcp://127.0.0.1:{replay}")
    reference = make_engine(tokenizer, prefix=False)
    expected = run(reference, {"long": PROMPT})["long"][0]
    reference.close()
    ctx = zmq.Context()
    try:
        run(engine, {"cached": list(range(100, 120))})              # blocks nobody holds after it
        session_tokens, _, _ = turn(engine, "s1", SESSION_PROMPT, session_id="s")
        engine.add_request("long", PROMPT, GREEDY)
        tokens = []
        for _ in range(3):                                          # the prompt and two decodes
            tokens += [t for out in engine.step() for t in out.new_token_ids]
        pool = engine.scheduler.kv.pool
        held = {h for h, b in pool.cached.items() if b.ref_cnt > 0}
        evictable = pool.stats().num_evictable
        before = len(published(ctx, f"tcp://127.0.0.1:{replay}", 1))
        reset = engine.reset_prefix_cache()
        assert reset.dropped["device"] == evictable >= 7 and reset.kept["device"] == len(held) > 0
        assert set(pool.cached) == held
        batches = published(ctx, f"tcp://127.0.0.1:{replay}", before + 1)
        cleared = decode_batch(batches[before]).events
        assert isinstance(cleared[0], AllBlocksCleared) and all(isinstance(e, BlockStored) for e in cleared[1:])
        assert device_view(batches) == held
        while engine.has_unfinished():
            tokens += [t for out in engine.step() for t in out.new_token_ids]
        assert tokens == expected                                   # the running request never noticed
        _, cached, _ = turn(engine, "s2", SESSION_PROMPT + session_tokens + [7, 8, 9], session_id="s")
        assert cached == len(SESSION_PROMPT) + len(session_tokens) - 1
        assert device_view(published(ctx, f"tcp://127.0.0.1:{replay}", len(batches) + 1)) == set(pool.cached)
    finally:
        ctx.term()
        engine.close()
