"""KV on disk survives a SIGKILL: ``kvhive serve --disk-cache-dir D`` on the default model is killed
mid-run and restarted; a long prompt it served comes back from disk (>= 90% cached) with the same
greedy tokens. Also the helper that runs ``python -m kvhive.cli serve`` for the tier e2e tests."""

from __future__ import annotations

import threading
import time

import httpx
from support.kvhive_serve import LONG_PROMPT, ServeProcess


def test_disk_tier_survives_sigkill(tmp_path):
    flags = ("--disk-cache-dir", str(tmp_path), "--max-num-batched-tokens", "512")
    server = ServeProcess(*flags)
    try:
        text, num_prompt, cached = server.complete(LONG_PROMPT)
        assert num_prompt > 900 and cached == 0
        server.wait_for_saves("disk")
        # Kill it mid-run: a second long prompt is being prefilled and saved when SIGKILL lands.
        other = threading.Thread(target=lambda: _ignore_errors(server.complete, LONG_PROMPT[::-1], 32))
        other.start()
        time.sleep(1.5)
        server.kill()
        other.join()
    finally:
        if server.process.poll() is None:
            server.kill()
    restarted = ServeProcess(*flags)
    try:
        again, num_prompt_again, cached_again = restarted.complete(LONG_PROMPT)
        assert num_prompt_again == num_prompt
        assert cached_again >= 0.9 * num_prompt
        assert again == text
        assert restarted.metric("kvhive_kv_tier_hit_tokens_total", "disk") >= 0.9 * num_prompt
    finally:
        restarted.stop()


def _ignore_errors(fn, *args) -> None:
    try:
        fn(*args)
    except httpx.HTTPError:
        pass
