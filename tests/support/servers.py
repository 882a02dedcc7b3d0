"""Real kvhive server subprocesses on free ports, reached over real HTTP, and the files they log to.

``start_server`` runs ``support/serve_faulty.py`` (the test server: the tiny or the default model,
optionally with injected faults; the markers below say which prompts fail where). Nothing a passing
run writes stays in the system temp dir: the subprocesses' logs go to ``log_file``, under the run's
base temp dir, which the session fixture in ``tests/conftest.py`` hands to ``set_log_dir``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

import httpx

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO_ROOT = os.path.dirname(TESTS_DIR)
SERVED_MODEL_NAME = "smollm2-135m"
FAULT_TOKEN_IDS = [0, 0, 0, 0]          # a completion prompt starting with these fails in --faulty servers
FAULT_MARKER = "<<kvhive: inject an engine failure>>"     # a prompt whose text holds this fails mid-way
FAULT_AFTER_OUTPUTS = 3                 # outputs sent before that failure (fewer if generation ends first)
ROW_FAULT_MARKER = "<<kvhive: fail sampling this row>>"
STEP_FAULT_MARKER = "<<kvhive: fail the steps computing this>>"
LOOP_FAULT_MARKER = "<<kvhive: kill the engine loop>>"
SLOW_MARKER = "<<kvhive: deliver slowly>>"        # each output of such a prompt waits 20 ms (a long turn)
TINY_API_KEY = "tiny-test-key"
DEFAULT_API_KEY = "e2e-secret"          # the key of the default-model server fixture
TINY_MAX_MODEL_LEN = 512
# The device the servers these helpers start run on: "cpu" (CI), or e.g. "cuda" to run the HTTP
# end-to-end tests on a GPU (``KVHIVE_TEST_DEVICE=cuda pytest tests/e2e``).
TEST_DEVICE = os.environ.get("KVHIVE_TEST_DEVICE", "cpu")

_log_dir: list[str] = []            # the run's log dir while a test session runs (set_log_dir)


def set_log_dir(path: str | None) -> None:
    """Where ``log_file`` puts its files from now on (None: the system temp dir)."""
    _log_dir[:] = [path] if path else []


def log_file(prefix: str) -> IO[bytes]:
    """A new file (left open for writing) for a subprocess's output, under the run's base temp dir."""
    return tempfile.NamedTemporaryFile(prefix=prefix, suffix=".log", dir=(_log_dir or [None])[0], delete=False)


def log_tail(path: str, num_chars: int = 3000) -> str:
    """The end of a subprocess's log file."""
    with open(path, errors="replace") as f:
        return f.read()[-num_chars:]


def subprocess_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment plus ``extra``, with the repository and tests/ on PYTHONPATH."""
    path = os.pathsep.join([REPO_ROOT, TESTS_DIR, os.environ.get("PYTHONPATH", "")])
    return {**os.environ, **(extra or {}), "PYTHONPATH": path}


_HANDED_OUT: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


_LOWEST_PORT = 20000


def free_port() -> int:
    """A TCP port nobody listens on right now, not handed out before in this process, and below the
    kernel's ephemeral range, so that no outgoing connection (a test's own HTTP client) takes it between
    now and the moment a server binds it. Never below 20000: Ray keeps 10001-19999 for its client server
    and workers and refuses a head port there."""
    low, _ = _ephemeral_range()
    rng = random.Random()
    if low > _LOWEST_PORT + 2000:
        for _ in range(200):
            port = rng.randrange(_LOWEST_PORT, low)
            if port not in _HANDED_OUT and _bindable(port):
                _HANDED_OUT.add(port)
                return port
    while True:                     # no room below the ephemeral range: let the kernel pick
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``condition`` every 50 ms; AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def healthy(url: str, timeout_s: float = 1.0) -> bool:
    """Whether ``url``/health answers 200 now."""
    try:
        return httpx.get(f"{url}/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def wait_healthy(process: subprocess.Popen, url: str, log_path: str, timeout_s: float) -> bool:
    """Poll ``url``/health until it answers 200 (True) or ``timeout_s`` passes (False); RuntimeError
    with the end of the log at ``log_path`` when the process exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{log_tail(log_path)}")
        if healthy(url, timeout_s=2.0):
            return True
        time.sleep(0.1)
    return False


def metric_samples(metrics_text: str, name: str, labels: dict[str, str] | None = None) -> list[float]:
    """The values of ``name``'s samples in a Prometheus text whose labels include ``labels``."""
    values = []
    for line in metrics_text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if match and match.group(1) == name:
            found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
            if all(found.get(k) == v for k, v in (labels or {}).items()):
                values.append(float(match.group(3)))
    return values


@dataclass
class ServerProcess:
    """A running ``kvhive`` server subprocess and how to reach it."""

    base_url: str
    process: subprocess.Popen[bytes]
    log_path: str

    def log_tail(self, num_chars: int = 4000) -> str:
        """The end of the server's combined stdout/stderr."""
        return log_tail(self.log_path, num_chars)

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        """One sample from /metrics (0.0 when absent); labels must all match."""
        samples = metric_samples(httpx.get(f"{self.base_url}/metrics", timeout=10).text, name, labels)
        return samples[0] if samples else 0.0


def serve_command(model: str, port: int, *args: str) -> list[str]:
    """The command line of a test server (``support/serve_faulty.py``) on ``port``."""
    return [sys.executable, "-m", "support.serve_faulty", "--model", model, "--port", str(port), *args]


def start_server(model: str, *, api_keys: tuple[str, ...] = (), max_model_len: int | None = None,
                 faulty: bool = False, startup_timeout_s: float = 180.0,
                 extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None,
                 command_prefix: tuple[str, ...] = ()) -> ServerProcess:
    """Start a server subprocess and wait until /health answers 200.

    ``extra_args``: more flags of the server script (``--num-blocks``, ``--kv-cache-gb``, ``--cpu-offload-gb``,
    ``--disk-cache-dir``, ``--redis-url``, the session flags, ``--no-prefix-caching``,
    ``--served-model-name``). ``env``: more environment variables for the server process.
    ``command_prefix``: what runs the server (e.g. ``nsenter`` into a mount namespace).
    """
    port = free_port()
    args = list(extra_args)
    for key in api_keys:
        args += ["--api-key", key]
    if max_model_len is not None:
        args += ["--max-model-len", str(max_model_len)]
    if faulty:
        args.append("--faulty")
    log = log_file(f"kvhive-server-{port}-")
    process = subprocess.Popen([*command_prefix, *serve_command(model, port, *args)], stdout=log,
                               stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=subprocess_env(env))
    server = ServerProcess(f"http://127.0.0.1:{port}", process, log.name)
    if wait_healthy(process, server.base_url, log.name, startup_timeout_s):
        return server
    stop_server(server)
    raise RuntimeError(f"server did not become healthy in {startup_timeout_s}s:\n{server.log_tail()}")


def stop_server(server: ServerProcess) -> None:
    """SIGTERM (graceful uvicorn shutdown), then SIGKILL if it lingers."""
    server.process.terminate()
    try:
        server.process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(server.log_path)


def kill_server(server: ServerProcess) -> None:
    """SIGKILL: no graceful shutdown (what a crash leaves behind); the log stays for a restart."""
    server.process.kill()
    server.process.wait()


def read_sse(response: httpx.Response) -> list[dict[str, Any] | str]:
    """The events of a streamed response: parsed JSON payloads, and "[DONE]" as a string."""
    events: list[dict[str, Any] | str] = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events
