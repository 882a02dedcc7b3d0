"""KV tiers end to end on the default model through real HTTP: greedy tokens are equal for a cold
run, a device-pool hit, a CPU-tier hit (after the device pool evicted the prompt) and a Redis hit
from a second ``kvhive serve`` process; per-tier metrics show where the tokens came from."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.kvhive_serve import LONG_PROMPT, ServeProcess
from support.redis_server import RedisServer, needs_redis_server

redis = pytest.importorskip("redis")

pytestmark = needs_redis_server
PROMPT = LONG_PROMPT[:1500]                   # ~560 tokens: 35 blocks
FLOOD = [f"Note {k}: " + LONG_PROMPT[1500 + 300 * k:][:1500] for k in range(3)]


@pytest.fixture(scope="module")
def server(module_redis_server: RedisServer) -> Iterator[ServeProcess]:
    # 64 blocks (1024 tokens) of device KV: the flood below evicts PROMPT from the pool.
    srv = ServeProcess("--num-blocks", "64", "--cpu-offload-gb", "1", "--redis-url", module_redis_server.url,
                       "--max-num-batched-tokens", "512")
    yield srv
    srv.stop()


def test_device_cpu_and_redis_hits_give_the_cold_tokens(server, module_redis_server):
    cold, num_prompt, cached = server.complete(PROMPT)
    assert cached == 0 and num_prompt > 500
    assert server.complete(PROMPT) == (cold, num_prompt, num_prompt - 1)      # device hit: all but the last token
    assert server.metric("kvhive_kv_tier_hit_tokens_total", "cpu") == 0
    for text in FLOOD:
        server.complete(text, max_tokens=2)
    again, _, cached = server.complete(PROMPT)                                              # CPU tier hit
    assert again == cold and cached >= 0.9 * num_prompt
    assert server.metric("kvhive_kv_tier_hit_tokens_total", "cpu") >= 0.9 * num_prompt
    server.wait_for_saves("redis")
    assert module_redis_server.admin().dbsize() >= num_prompt // 16

    second = ServeProcess("--redis-url", module_redis_server.url)                                  # another replica
    try:
        text, _, cached = second.complete(PROMPT)
        assert text == cold and cached >= 0.9 * num_prompt
        assert second.metric("kvhive_kv_tier_hit_tokens_total", "redis") >= 0.9 * num_prompt
    finally:
        second.stop()
