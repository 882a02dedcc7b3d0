"""The Redis tier under faults, on a tiny model against a real redis-server: stopped, paused (slow)
and full Redis never stops serving; a restarted Redis works again without restarting the engine;
corrupt values are misses; a second engine reads what the first one saved, and keeps a copy on
its local disk."""

from __future__ import annotations

import os
import signal
import time

import pytest
from support.engines import GREEDY, make_engine, run
from support.redis_server import needs_redis_server

from kvhive.config import StoreConfig

redis = pytest.importorskip("redis")

pytestmark = needs_redis_server

PROMPTS = {f"p{j}": [(7 * i + 13 * j + 3) % 250 + 3 for i in range(60)] for j in range(5)}   # 14 blocks


@pytest.fixture(scope="module")
def fresh(tokenizer) -> dict[str, list[int]]:
    return {k: v[0] for k, v in run(make_engine(tokenizer, prefix=False), PROMPTS).items()}


def redis_engine(tokenizer, redis_server):
    return make_engine(tokenizer, num_blocks=64, store=StoreConfig(redis_url=redis_server.url, redis_timeout_s=0.2))


def wait_for_redis(engine, timeout_s: float = 40.0) -> None:
    """Until the Redis tier's breaker has closed again (its probe backs off 1 s, 2 s, 4 s ...)."""
    tier = engine.store.tiers[-1].store
    deadline = time.monotonic() + timeout_s
    while not tier.available:
        assert time.monotonic() < deadline, "Redis tier did not come back"
        time.sleep(0.05)


def one(engine, name: str):
    return run(engine, {name: PROMPTS[name]})[name]


def redis_errors(engine) -> int:
    return {t.name: t.store.errors for t in engine.stats().tiers}["redis"]


def test_second_engine_hits_what_the_first_saved_and_corrupt_values_miss(tokenizer, fresh, redis_server):
    first = redis_engine(tokenizer, redis_server)
    one(first, "p0")
    one(first, "p1")
    first.close()
    assert redis_server.admin().dbsize() > 0
    second = redis_engine(tokenizer, redis_server)
    try:
        assert one(second, "p0") == (fresh["p0"], 56)
        assert {t.name: t.hit_tokens for t in second.stats().tiers} == {"redis": 56}
        admin = redis_server.admin()
        redis_tier = second.store.tiers[-1].store
        keys = sorted(redis_tier.redis_key(second.connector_scheduler.key_space.key(h))
                      for h in _hashes(second, "p1"))
        for i, key in enumerate(keys):                 # garble, truncate, or swap every value
            value = admin.get(key)
            admin.set(key, [value[:-1] + bytes([value[-1] ^ 1]), value[: len(value) // 2],
                            admin.get(keys[(i + 1) % len(keys)])][i % 3])
        tokens, cached = one(second, "p1")
        assert tokens == fresh["p1"] and cached == 0
        assert redis_errors(second) >= 1
    finally:
        second.close()


def _hashes(engine, name: str) -> list[bytes]:
    from kvhive.request import Request, SamplingParams

    request = Request("probe", list(PROMPTS[name]), SamplingParams())
    engine.scheduler.kv._update_block_hashes(request)
    return request.block_hashes


def test_a_redis_hit_is_promoted_to_the_local_disk(tokenizer, fresh, redis_server, tmp_path):
    first = redis_engine(tokenizer, redis_server)
    one(first, "p0")
    first.close()
    disk = str(tmp_path / "disk")
    second = make_engine(tokenizer, num_blocks=64, store=StoreConfig(disk_cache_dir=disk, redis_url=redis_server.url,
                                                                     redis_timeout_s=0.2))
    try:
        assert one(second, "p0") == (fresh["p0"], 56)
        assert {t.name: t.hit_tokens for t in second.stats().tiers} == {"disk": 0, "redis": 56}
    finally:
        second.close()
    third = make_engine(tokenizer, num_blocks=64, store=StoreConfig(disk_cache_dir=disk))   # no Redis
    try:
        assert one(third, "p0") == (fresh["p0"], 56)
        assert {t.name: t.hit_tokens for t in third.stats().tiers} == {"disk": 56}
    finally:
        third.close()


def test_a_slow_redis_lookup_does_not_stall_running_requests(tokenizer, fresh, redis_server):
    from kvhive.request import RequestStatus

    engine = make_engine(tokenizer, num_blocks=64, store=StoreConfig(redis_url=redis_server.url, redis_timeout_s=1.0))
    try:
        engine.add_request("p0", PROMPTS["p0"], GREEDY)
        tokens: dict[str, list[int]] = {"p0": [], "p1": []}
        while not tokens["p0"]:          # "p0" runs: its lookup answered (it may take a few steps)
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
        os.kill(redis_server.process.pid, signal.SIGSTOP)              # every Redis call now takes 1 s
        engine.add_request("p1", PROMPTS["p1"], GREEDY)
        slowest_step = 0.0
        while engine.scheduler.get_request("p1").status is RequestStatus.WAITING:
            start = time.monotonic()
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
            slowest_step = max(slowest_step, time.monotonic() - start)
        assert len(tokens["p0"]) >= 6 and slowest_step < 0.9    # "p0" kept stepping meanwhile
        os.kill(redis_server.process.pid, signal.SIGCONT)
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
        assert tokens == {"p0": fresh["p0"], "p1": fresh["p1"]}
    finally:
        os.kill(redis_server.process.pid, signal.SIGCONT)
        engine.close()


def test_stopped_slow_and_full_redis_keep_serving_and_recover(tokenizer, fresh, redis_server):
    engine = redis_engine(tokenizer, redis_server)
    try:
        redis_server.stop()                                            # down
        assert one(engine, "p0")[0] == fresh["p0"]
        engine.connector_worker.wait_for_save()
        assert redis_errors(engine) >= 1
        redis_server.start()                                           # back, same port, empty
        wait_for_redis(engine)                                   # the breaker's probe finds it
        assert one(engine, "p1")[0] == fresh["p1"]
        engine.connector_worker.wait_for_save()
        assert redis_server.admin().dbsize() > 0                       # saves land again, no restart

        os.kill(redis_server.process.pid, signal.SIGSTOP)              # slow: every call times out
        start = time.monotonic()
        assert one(engine, "p2")[0] == fresh["p2"]
        engine.connector_worker.wait_for_save()
        assert time.monotonic() - start < 10
        os.kill(redis_server.process.pid, signal.SIGCONT)
        wait_for_redis(engine)

        admin = redis_server.admin()                                   # full: SET answers OOM
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", str(admin.info("memory")["used_memory"]))
        before = admin.dbsize()
        assert one(engine, "p3")[0] == fresh["p3"]
        engine.connector_worker.wait_for_save()
        assert admin.dbsize() == before
        admin.config_set("maxmemory", "0")
        time.sleep(1.1)
        assert one(engine, "p4")[0] == fresh["p4"]
        engine.connector_worker.wait_for_save()
        assert admin.dbsize() > before                           # writes work again
    finally:
        engine.close()
    second = redis_engine(tokenizer, redis_server)                     # what the recovered tier holds is read back
    try:
        assert one(second, "p4") == (fresh["p4"], 56)
    finally:
        second.close()
