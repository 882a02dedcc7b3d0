"""DurableState: which tiers and record backends a StoreConfig gives, and their Redis key names
(no Redis server: nothing here makes a call)."""

from __future__ import annotations

import pytest

from kvhive.config import StoreConfig
from kvhive.sessions.backends import FileBackend, RedisBackend
from kvhive.sessions.durable import DurableState
from kvhive.sessions.response_backends import FileResponseBackend, RedisResponseBackend
from kvhive.store.key import KeySpace
from kvhive.store.redis_keys import RedisKeys

URL = "redis://127.0.0.1:1/0"       # never reached


def test_one_namespace_per_model():
    keys = RedisKeys("smollm2-135m")
    assert keys.namespace == "kvhive:smollm2-135m"
    assert keys.kv_blocks == b"kvhive:smollm2-135m:kv:"
    assert keys.sessions == "kvhive:smollm2-135m:sessions"
    assert keys.responses == "kvhive:smollm2-135m:responses"
    with pytest.raises(ValueError, match="model name"):
        RedisKeys("")


def test_nothing_configured_builds_nothing():
    durable = DurableState(StoreConfig(), "m")
    assert durable.tiered_store() is None
    assert durable.session_backend() is None
    assert durable.response_backend() is None


def test_disk_dir_holds_blocks_sessions_and_responses(tmp_path):
    durable = DurableState(StoreConfig(cpu_offload_gb=0.01, disk_cache_dir=str(tmp_path)), "m")
    store = durable.tiered_store()
    assert [(t.name, t.write_through) for t in store.tiers] == [("cpu", False), ("disk", True)]
    store.close()
    assert isinstance(durable.session_backend(), FileBackend)
    assert isinstance(durable.response_backend(), FileResponseBackend)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["responses", "sessions"]


def test_redis_keys_carry_the_model_namespace(tmp_path):
    durable = DurableState(StoreConfig(disk_cache_dir=str(tmp_path), redis_url=URL), "m")
    store = durable.tiered_store()
    assert [(t.name, t.write_through) for t in store.tiers] == [("disk", True), ("redis", True)]
    redis_tier = store.tiers[1].store
    block = KeySpace("fp", 1, "float32", 16).key(bytes(16))
    assert redis_tier.redis_key(block) == b"kvhive:m:kv:" + block.encode()
    store.close()
    sessions, responses = durable.session_backend(), durable.response_backend()
    assert isinstance(sessions, RedisBackend) and isinstance(responses, RedisResponseBackend)
    assert sessions.key("owner", "sess-1") == "kvhive:m:sessions:owner:sess-1"
    assert sessions.key(None, "sess-1") == "kvhive:m:sessions:-:sess-1"
    assert responses.key("owner", "conv-1") == "kvhive:m:responses:owner:conv-1"
