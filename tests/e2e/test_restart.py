"""KV on disk survives a SIGKILL: ``kvhive serve --disk-cache-dir D`` on the default model is killed
mid-run and restarted; a long prompt it served comes back from disk (>= 90% cached) with the same
greedy tokens. Also the helper that runs ``python -m kvhive.cli serve`` for the tier e2e tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
from conftest import TEST_DEVICE, log_file

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LONG_PROMPT = " ".join(f"Item {i}: the {['red', 'blue', 'green'][i % 3]} box holds {i * 7 % 50} marbles."
                       for i in range(70))


class ServeProcess:
    """``python -m kvhive.cli serve`` on the default model in a subprocess, on a free port."""

    def __init__(self, *flags: str, timeout_s: float = 240.0) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_file("kvhive-tiers-")
        cmd = [sys.executable, "-m", "kvhive.cli", "serve", "--port", str(self.port), "--num-threads", "2",
               "--log-level", "warning", "--device", TEST_DEVICE, *flags]
        env = {**os.environ, "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.process = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"kvhive serve exited:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"kvhive serve did not start:\n{self.log_tail()}")

    def log_tail(self) -> str:
        """The end of the server's output."""
        with open(self.log.name, errors="replace") as f:
            return f.read()[-4000:]

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
