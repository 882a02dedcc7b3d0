"""Idle sessions when the lowest store tier loses their blocks (a Redis flushed, restarted or down),
in the engine on a tiny random model: the holding falls back to a tier above that has a copy, or
is released to be recomputed; a request never waits for blocks that will never come."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from support.engines import GREEDY, make_engine, turn
from support.tiny import tiny_config, tiny_model

from kvhive.config import CacheConfig, EngineConfig, SchedulerConfig
from kvhive.engine.llm_engine import LLMEngine
from kvhive.engine.scheduler import SessionCopy
from kvhive.model.loader import LoadedModel
from kvhive.store.base import PutResult, StatsCounter, StoreStats
from kvhive.store.key import StoreKey
from kvhive.store.memory import MemoryStore
from kvhive.store.tiered import Tier, TieredStore

SESSIONS = {f"s{k}": [10 + k + j % 50 for j in range(40)] for k in range(3)}   # 3 x 11 of 39 blocks
BIG = [200 + j % 30 for j in range(60)]


class SharedTier:
    """A stand-in for Redis: no budget of its own; ``flush`` empties it, ``down`` refuses everything."""

    def __init__(self) -> None:
        self._blocks: dict[StoreKey, bytes] = {}
        self._lock = threading.Lock()
        self._stats = StatsCounter()
        self.down = False

    def flush(self) -> None:
        with self._lock:
            self._blocks.clear()

    def contains(self, keys: Sequence[StoreKey]) -> list[bool]:
        with self._lock:
            return [not self.down and k in self._blocks for k in keys]

    def get(self, key: StoreKey):
        with self._lock:
            payload = None if self.down else self._blocks.get(key)
        self._stats.record_get(None if payload is None else len(payload), 0.0)
        return payload

    def put(self, key: StoreKey, payload) -> PutResult:
        if self.down:
            return PutResult(False)
        with self._lock:
            self._blocks[key] = bytes(payload)
        return PutResult(True)

    def delete(self, key: StoreKey) -> None:
        with self._lock:
            self._blocks.pop(key, None)

    def pin(self, keys: Iterable[StoreKey]) -> None:
        pass

    def unpin(self, keys: Iterable[StoreKey]) -> None:
        pass

    def stats(self) -> StoreStats:
        return self._stats.snapshot(None, None)

    def close(self) -> None:
        pass


def engine_over(tokenizer, shared: SharedTier, cpu_bytes: int = 0) -> LLMEngine:
    """``make_engine``'s tiny engine (40 blocks of 4 tokens) over these tiers."""
    tiers = [Tier("cpu", MemoryStore(cpu_bytes))] if cpu_bytes else []
    tiers.append(Tier("redis", shared, write_through=True))
    cfg = tiny_config(max_position_embeddings=512)
    config = EngineConfig(model_path="tiny", cache=CacheConfig(block_size=4, num_blocks=40),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512))
    return LLMEngine(config, loaded=LoadedModel(cfg, tiny_model(cfg), "tiny-engine-test"), tokenizer=tokenizer,
                     store=TieredStore(tiers))


def fill_with_sessions(engine) -> dict[str, list[int]]:
    outs = {}
    for sid, prompt in SESSIONS.items():
        outs[sid], _, _ = turn(engine, sid, prompt, sid)
        engine.connector_worker.wait_for_save()
    return outs


def test_an_emptied_lowest_tier_never_stalls_a_request(tokenizer):
    shared = SharedTier()
    engine = engine_over(tokenizer, shared)
    try:
        outs = fill_with_sessions(engine)
        copies = {sid: engine._session_copy(engine.scheduler.kv.sessions.get(sid).block_hashes[:10])
                  for sid in SESSIONS}
        assert set(copies.values()) == {SessionCopy.LOWEST}
        shared.flush()                                   # Redis lost every block
        assert engine._session_copy(engine.scheduler.kv.sessions.get("s0").block_hashes[:10]) \
            is SessionCopy.NONE
        tokens, _, _ = turn(engine, "big", BIG)          # ran: a holding was released to recompute
        assert len(tokens) == GREEDY.max_tokens
        assert engine.scheduler.kv.sessions.get("s0") is None
        # The released session stays usable: its next turn recomputes what is missing.
        fresh = make_engine(tokenizer, prefix=False)
        prompt = SESSIONS["s0"] + outs["s0"] + [7, 8, 9]
        assert turn(engine, "s0-2", prompt, "s0")[0] == turn(fresh, "x", prompt)[0]
    finally:
        engine.close()


def test_a_down_lowest_tier_spills_to_the_tier_above(tokenizer):
    shared = SharedTier()
    engine = engine_over(tokenizer, shared, cpu_bytes=64 << 20)
    try:
        shared.down = True                               # Redis unreachable while the turns save
        outs = fill_with_sessions(engine)
        hashes = engine.scheduler.kv.sessions.get("s0").block_hashes[:10]
        assert engine._session_copy(hashes) is SessionCopy.HIGHER
        tokens, _, _ = turn(engine, "big", BIG)
        assert len(tokens) == GREEDY.max_tokens
        assert engine.scheduler.num_session_spills >= 1
        # The spilled session's blocks come back from the CPU tier.
        spilled = next(sid for sid in SESSIONS if engine.scheduler.kv.sessions.get(sid) is None)
        tokens, cached, _ = turn(engine, "again", SESSIONS[spilled] + outs[spilled] + [7], spilled)
        assert cached >= 40 and len(tokens) == GREEDY.max_tokens
    finally:
        engine.close()
