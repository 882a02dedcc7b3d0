"""/metrics is current while the server is idle: the device blocks by state (free, cached, used)
add up to the pool, and store saves that finish after the last request show without another one
(a real server with a disk tier, over HTTP; the engine's own stats: tests/engine/test_engine_stats.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from support.servers import ServerProcess, start_server, stop_server

from kvhive.engine.async_engine import IDLE_STATS_REFRESH_S


@pytest.fixture()
def disk_server(tmp_path) -> Iterator[ServerProcess]:
    server = start_server("tiny", max_model_len=512, extra_args=("--disk-cache-dir", str(tmp_path),
                                                                 "--num-blocks", "128"))
    yield server
    stop_server(server)


def test_an_idle_server_shows_finished_saves_and_block_states(disk_server: ServerProcess) -> None:
    metric = disk_server.metric
    assert metric("kvhive_kv_blocks", {"state": "free"}) == 127
    prompt = " ".join(f"line {i} of a prompt long enough to fill some blocks." for i in range(30))
    r = httpx.post(f"{disk_server.base_url}/v1/completions", timeout=60,
                   json={"model": "smollm2-135m", "prompt": prompt, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    num_prompt = r.json()["usage"]["prompt_tokens"]
    # No request from here on: only the idle engine loop can bring the snapshot up to date.
    deadline, last = time.monotonic() + 30, -1.0
    while time.monotonic() < deadline:
        saved = metric("kvhive_kv_tier_bytes_in_total", {"tier": "disk"})
        if saved > 0 and saved == last:
            break                                   # the writer has caught up, and it shows
        last = saved
        time.sleep(4 * IDLE_STATS_REFRESH_S)
    assert saved > 0
    assert metric("kvhive_kv_tier_usage_bytes", {"tier": "disk"}) >= saved
    free, cached, used = (metric("kvhive_kv_blocks", {"state": s}) for s in ("free", "cached", "used"))
    assert used == 0 and cached >= num_prompt // 16 and free + cached + used == 127
    assert metric("kvhive_cache_num_blocks") == 128
