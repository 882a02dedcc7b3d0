"""``kvhive serve`` itself (the CLI, not the test server) on the default model in a subprocess, and a
prompt long enough to fill the KV tiers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
from support.servers import (
    REPO_ROOT,
    TEST_DEVICE,
    free_port,
    log_file,
    log_tail,
    subprocess_env,
    wait_healthy,
)

LONG_PROMPT = " ".join(f"Item {i}: the {['red', 'blue', 'green'][i % 3]} box holds {i * 7 % 50} marbles."
                       for i in range(70))


class ServeProcess:
    """``python -m kvhive.cli serve`` on the default model in a subprocess, on a free port."""

    def __init__(self, *flags: str, timeout_s: float = 240.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_file("kvhive-tiers-")
        cmd = [sys.executable, "-m", "kvhive.cli", "serve", "--port", str(self.port), "--num-threads", "2",
               "--log-level", "warning", "--device", TEST_DEVICE, *flags]
        self.process = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                        env=subprocess_env())
        if wait_healthy(self.process, self.url, self.log.name, timeout_s):
            return
        self.kill()
        raise RuntimeError(f"kvhive serve did not start:\n{self.log_tail()}")

    def log_tail(self) -> str:
        """The end of the server's output."""
        return log_tail(self.log.name, 4000)

    def complete(self, prompt: str, max_tokens: int = 8) -> tuple[str, int, int]:
        """Greedy completion: (text, prompt tokens, cached tokens)."""
        r = httpx.post(f"{self.url}/v1/completions", timeout=300, json={
            "model": "smollm2-135m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True})
        r.raise_for_status()
        body = r.json()
        usage = body["usage"]
        return body["choices"][0]["text"], usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]

    def metric(self, name: str, tier: str) -> float:
        """One per-tier sample from /metrics (0.0 when absent)."""
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.startswith(name + "{") and f'tier="{tier}"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def wait_for_saves(self, tier: str, timeout_s: float = 30.0) -> None:
        """Wait until the tier's bytes_in stops growing (the writer has caught up)."""
        last, deadline = -1.0, time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            now = self.metric("kvhive_kv_tier_bytes_in_total", tier)
            if now == last and now > 0:
                return
            last = now
            time.sleep(0.5)

    def kill(self) -> None:
        """SIGKILL: no shutdown hooks, no index snapshot."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        """SIGTERM (graceful), then SIGKILL."""
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()
        os.unlink(self.log.name)
