"""A real ``redis-server`` subprocess on a free port, for the tests of everything kvhive keeps in Redis.

Where ``redis-server`` is not installed the test that asks for one is skipped, except under CI
(``CI`` set; ``scripts/test.sh`` installs it there), where a missing server is a failure.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from support.servers import free_port

# For a module whose every test needs redis-server: skipped before its other fixtures run.
needs_redis_server = pytest.mark.skipif(shutil.which("redis-server") is None and not os.environ.get("CI"),
                                        reason="redis-server is not installed")


def require_redis_server() -> None:
    """Skip the calling test when redis-server or the redis client is missing (fail under CI)."""
    if shutil.which("redis-server") is None and not os.environ.get("CI"):
        pytest.skip("redis-server is not installed")
    pytest.importorskip("redis")


class RedisServer:
    """A redis-server subprocess on a fixed port that a test can stop, pause and start again."""

    def __init__(self, port: int, workdir: str, password: str | None = None) -> None:
        self.port = port
        self.workdir = workdir
        self.password = password
        self.url = f"redis://{f':{password}@' if password else ''}127.0.0.1:{port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start it (no persistence, data under ``workdir``; with ``password``, clients must give it)
        and wait until it answers PING."""
        import redis

        auth = ["--requirepass", self.password] if self.password else []
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.workdir, *auth],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if redis.Redis(port=self.port, password=self.password, socket_timeout=1).ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        """SIGKILL it (resumed first if a test paused it with SIGSTOP); its data is gone."""
        if self.process is not None:
            os.kill(self.process.pid, signal.SIGCONT)
            self.process.kill()
            self.process.wait()
            self.process = None

    def admin(self):  # -> redis.Redis
        """A client for the test's own commands (FLUSHALL, CONFIG SET, ...)."""
        import redis

        return redis.Redis(port=self.port, password=self.password, socket_timeout=5)


@contextmanager
def running_redis_server(workdir: str, password: str | None = None) -> Iterator[RedisServer]:
    """A started RedisServer on a free port (with ``password``: one that requires it), stopped on
    exit (skips the test where there is none)."""
    require_redis_server()
    server = RedisServer(free_port(), workdir, password)
    server.start()
    try:
        yield server
    finally:
        server.stop()
