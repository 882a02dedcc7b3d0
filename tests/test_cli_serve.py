"""``kvhive serve`` as a process: a taken port is an error exit, SIGINT a clean one."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

import httpx
from conftest import free_port
from test_gateway import healthy, wait_until


def _serve(port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvhive.cli", "serve", "--port", str(port),
                             "--kv-cache-gb", "0.1", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_taken_port_exits_nonzero() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        proc = _serve(taken.getsockname()[1])
        out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 1, out
    assert "address already in use" in out


def test_sigint_stops_the_server_cleanly() -> None:
    port = free_port()
    proc = _serve(port)
    try:
        wait_until(lambda: proc.poll() is not None or healthy(f"http://127.0.0.1:{port}"), 180, "kvhive serve")
        assert proc.poll() is None
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": "smollm2-135m", "prompt": "Hello", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
