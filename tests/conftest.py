"""Shared fixtures: real kvhive servers in subprocesses on free ports, reached over real HTTP.

Run as a script, this file is also the server process the fixtures start:
``python tests/conftest.py --model tiny|default --port N [--api-key K] [--max-model-len N] [--faulty]
[--served-model-name NAME]``.
``tiny`` is a random-weight Llama (``tests/tiny.py``) behind the real tokenizer of the default GGUF;
``default`` is the real default model. ``--faulty`` makes prompts that start with
``FAULT_TOKEN_IDS`` fail inside the engine, and prompts whose text contains ``FAULT_MARKER`` (which
a chat-templated prompt can carry) fail after ``FAULT_AFTER_OUTPUTS`` outputs, so tests can see how
engine errors reach clients, also in the middle of a stream. Inside the engine itself: sampling a
row of a prompt holding ``ROW_FAULT_MARKER`` raises (in a batch too), the forward of every step
computing a prompt holding ``STEP_FAULT_MARKER`` raises, and a prompt holding ``LOOP_FAULT_MARKER``
kills the engine loop (the server then exits with status 1).

Nothing a passing run writes stays in the system temp dir: tests write under ``tmp_path`` (removed
once the test passes, the run's base temp dir once the run passes: ``tmp_path_retention_policy`` in
pyproject.toml), the subprocesses' logs go to ``log_file`` (under the run's base temp dir too), and
the run's summary lists any entry that appeared in the temp dir while it ran.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import httpx
import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
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
TINY_MAX_MODEL_LEN = 512
# The device the servers these fixtures start run on: "cpu" (CI), or e.g. "cuda" to run the HTTP
# end-to-end tests on a GPU (``KVHIVE_TEST_DEVICE=cuda pytest -m e2e``).
TEST_DEVICE = os.environ.get("KVHIVE_TEST_DEVICE", "cpu")
# Importing torch.nn.attention imports torch._dynamo, which makes its cache dir, by default
# $TMPDIR/torchinductor_$USER (kvhive compiles nothing with it): for the tests and the servers they
# start, that dir is one beside the kernels' cache instead.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "kvhive", "torchinductor"))


@dataclass
class ServerProcess:
    """A running ``kvhive`` server subprocess and how to reach it."""

    base_url: str
    process: subprocess.Popen[bytes]
    log_path: str

    def log_tail(self, num_chars: int = 4000) -> str:
        """The end of the server's combined stdout/stderr."""
        with open(self.log_path, errors="replace") as f:
            return f.read()[-num_chars:]

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        """One sample from /metrics (0.0 when absent); labels must all match."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        for line in text.splitlines():
            match = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
            if not match or match.group(1) != name:
                continue
            found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
            if all(found.get(k) == v for k, v in (labels or {}).items()):
                return float(match.group(3))
        return 0.0


# ---------------------------------------------------------------- the temp dir stays clean

_log_dir: str | None = None         # set for the run by the session fixture below
_TEMP_ENTRIES = pytest.StashKey[set[str]]()


def log_file(prefix: str) -> IO[bytes]:
    """A new file (left open for writing) for a subprocess's output, under the run's base temp dir."""
    return tempfile.NamedTemporaryFile(prefix=prefix, suffix=".log", dir=_log_dir, delete=False)


@pytest.fixture(scope="session", autouse=True)
def _subprocess_log_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    global _log_dir
    _log_dir = str(tmp_path_factory.mktemp("logs"))
    yield
    _log_dir = None


def _pytest_temp_root() -> str:
    """The directory pytest keeps its numbered base temp dirs in (``pytest-of-USER``)."""
    import getpass

    try:
        user = getpass.getuser()
    except (ImportError, OSError, KeyError):
        user = "unknown"
    return os.path.join(tempfile.gettempdir(), f"pytest-of-{user}")


def pytest_configure(config: pytest.Config) -> None:
    """Note the temp dir's entries before the run (see ``pytest_terminal_summary``)."""
    temp_dir = tempfile.gettempdir()
    config.stash[_TEMP_ENTRIES] = set(os.listdir(temp_dir))
    root = _pytest_temp_root()
    if not os.path.exists(root):
        # pytest removes a passing run's base temp dir but keeps the pytest-of-USER dir above it:
        # remove that too if this run made it and it is empty at exit. atexit runs handlers
        # last-registered first, so this runs after pytest's own cleanup (registered later).
        atexit.register(_remove_empty_dir, root)


def _remove_empty_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        os.rmdir(path)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """List the entries that appeared in the temp dir during the run (other than pytest's own
    ``pytest-of-USER``, see ``pytest_configure``): files the tests or their servers left behind, or
    that another process on this machine made meanwhile."""
    before = config.stash.get(_TEMP_ENTRIES, None)
    if before is None:
        return
    temp_dir = tempfile.gettempdir()
    new = sorted(set(os.listdir(temp_dir)) - before - {os.path.basename(_pytest_temp_root())})
    if new:
        terminalreporter.write_sep("-", f"new entries in {temp_dir}")
        terminalreporter.write_line(f"appeared in {temp_dir} during the run (left by the tests, or made "
                                    "by another process meanwhile):")
        for name in new:
            terminalreporter.write_line(f"  {os.path.join(temp_dir, name)}")


# ---------------------------------------------------------------- servers


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, *, api_keys: tuple[str, ...] = (), max_model_len: int | None = None,
                 faulty: bool = False, startup_timeout_s: float = 180.0,
                 extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> ServerProcess:
    """Start a server subprocess and wait until /health answers 200.

    ``extra_args``: more flags of the server script (``--num-blocks``, ``--kv-cache-gb``, ``--cpu-offload-gb``,
    ``--disk-cache-dir``, ``--redis-url``, the session flags, ``--no-prefix-caching``,
    ``--served-model-name``). ``env``: more environment variables for the server process.
    """
    port = free_port()
    cmd = [sys.executable, os.path.join(TESTS_DIR, "conftest.py"), "--model", model, "--port", str(port),
           *extra_args]
    for key in api_keys:
        cmd += ["--api-key", key]
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    if faulty:
        cmd.append("--faulty")
    log = log_file(f"kvhive-server-{port}-")
    env = {**os.environ, **(env or {}), "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env)
    server = ServerProcess(f"http://127.0.0.1:{port}", process, log.name)
    deadline = time.monotonic() + startup_timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
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


@pytest.fixture(scope="session")
def tiny_server() -> Iterator[ServerProcess]:
    """One tiny-model server (API key TINY_API_KEY, --faulty) shared by the whole session."""
    server = start_server("tiny", api_keys=(TINY_API_KEY,), max_model_len=TINY_MAX_MODEL_LEN, faulty=True)
    yield server
    stop_server(server)


@pytest.fixture()
def tiny_client(tiny_server: ServerProcess) -> Iterator[httpx.Client]:
    """An HTTP client for the tiny server that sends the right API key."""
    with httpx.Client(base_url=tiny_server.base_url, timeout=120,
                      headers={"Authorization": f"Bearer {TINY_API_KEY}"}) as client:
        yield client


# ---------------------------------------------------------------- the server process


def _build_engine(args: argparse.Namespace):  # -> AsyncEngine (imports stay inside the child)
    from kvhive.config import CacheConfig, EngineConfig, SchedulerConfig, SessionConfig, StoreConfig
    from kvhive.core.model_files import default_model_path
    from kvhive.engine.async_engine import AsyncEngine
    from kvhive.engine.core import LLMEngine

    scheduler = SchedulerConfig(max_model_len=args.max_model_len or 8192)
    store = StoreConfig(cpu_offload_gb=args.cpu_offload_gb, disk_cache_dir=args.disk_cache_dir,
                        redis_url=args.redis_url)
    sessions = SessionConfig(default_ttl_s=args.default_session_ttl, max_ttl_s=args.max_session_ttl,
                             max_sessions_per_key=args.max_sessions_per_key, max_pinned_gb=args.max_pinned_gb,
                             share_prefix_cache=args.share_prefix_cache)
    prefix = not args.no_prefix_caching
    if args.model == "default":
        config = EngineConfig(model_path=default_model_path(), served_model_name=SERVED_MODEL_NAME,
                              device=TEST_DEVICE,
                              cache=CacheConfig(kv_cache_gb=args.kv_cache_gb, num_blocks=args.num_blocks,
                                                enable_prefix_caching=prefix),
                              scheduler=scheduler, store=store, sessions=sessions)
        engine = LLMEngine(config)
    else:
        from kvhive.core.tokenizer import Tokenizer
        from kvhive.model.loader import LoadedModel

        sys.path.insert(0, TESTS_DIR)
        import tiny

        tokenizer = Tokenizer.from_model_path(default_model_path())
        model_config = tiny.tiny_config(vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_token_id,
                                        eos_token_ids=tokenizer.eos_token_ids)
        loaded = LoadedModel(model_config, tiny.tiny_model(model_config, device=TEST_DEVICE), "tiny-server-test")
        config = EngineConfig(model_path=default_model_path(), served_model_name=SERVED_MODEL_NAME,
                              device=TEST_DEVICE,
                              cache=CacheConfig(num_blocks=args.num_blocks or 256, enable_prefix_caching=prefix),
                              scheduler=scheduler, store=store, sessions=sessions)
        engine = LLMEngine(config, loaded=loaded, tokenizer=tokenizer)
    if not args.faulty:
        return AsyncEngine(engine)
    return _faulty(AsyncEngine, engine)


def _faulty(async_engine_class: type, engine):  # -> a FaultyAsyncEngine over engine
    """The ``--faulty`` engine: see this module's docstring for the markers."""
    faulty_rows: set[str] = set()           # engine request ids whose sampling raises
    faulty_steps: set[str] = set()          # engine request ids whose steps' forward raises
    runner = engine.runner
    sample_rows, execute = runner.sample_rows, runner.execute

    def faulty_sample_rows(logits, seqs):
        if any(s.request_id in faulty_rows for s in seqs):
            raise RuntimeError("injected row failure")
        return sample_rows(logits, seqs)

    def faulty_execute(plan):
        if any(s.request_id in faulty_steps for s in plan.seqs):
            raise RuntimeError("injected step failure")
        return execute(plan)

    runner.sample_rows, runner.execute = faulty_sample_rows, faulty_execute

    class FaultyAsyncEngine(async_engine_class):
        """Fails requests whose prompt starts with FAULT_TOKEN_IDS at once, and those whose text
        holds FAULT_MARKER after FAULT_AFTER_OUTPUTS outputs (or at their last), as a broken engine
        would; fails rows, steps and the loop itself for the other markers."""

        kill_loop = False

        def _apply_commands(self):
            if self.kill_loop:
                raise RuntimeError("injected engine loop failure")
            super()._apply_commands()

        async def generate(self, request_id, prompt_token_ids, sampling, cache_salt=None, **session):
            if list(prompt_token_ids[:len(FAULT_TOKEN_IDS)]) == FAULT_TOKEN_IDS:
                raise RuntimeError("injected engine failure")
            text = self.engine.tokenizer.decode(prompt_token_ids)
            fails_mid_way = FAULT_MARKER in text
            slow = SLOW_MARKER in text
            if ROW_FAULT_MARKER in text:
                faulty_rows.add(request_id)
            if STEP_FAULT_MARKER in text:
                faulty_steps.add(request_id)
            if LOOP_FAULT_MARKER in text:
                self.kill_loop = True
            outputs = super().generate(request_id, prompt_token_ids, sampling, cache_salt, **session)
            async with contextlib.aclosing(outputs):
                num_sent = 0
                async for out in outputs:
                    if fails_mid_way and (num_sent == FAULT_AFTER_OUTPUTS or out.finished):
                        raise RuntimeError("injected engine failure mid-way")
                    num_sent += 1
                    if slow:
                        await asyncio.sleep(0.02)
                    yield out

    return FaultyAsyncEngine(engine)


def _serve_main() -> None:
    parser = argparse.ArgumentParser(description="kvhive test server")
    parser.add_argument("--model", choices=["tiny", "default"], required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--api-key", action="append", default=[])
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--faulty", action="store_true")
    parser.add_argument("--num-blocks", type=int, default=None)
    parser.add_argument("--kv-cache-gb", type=float, default=0.25)     # the default model's pool
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--cpu-offload-gb", type=float, default=0.0)
    parser.add_argument("--disk-cache-dir", default=None)
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--default-session-ttl", type=int, default=600)
    parser.add_argument("--max-session-ttl", type=int, default=86400)
    parser.add_argument("--max-sessions-per-key", type=int, default=None)
    parser.add_argument("--max-pinned-gb", type=float, default=None)
    parser.add_argument("--share-prefix-cache", action="store_true")
    parser.add_argument("--served-model-name", default=SERVED_MODEL_NAME)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(2)
    from kvhive.server.app import run_server

    served = run_server(_build_engine(args), host="127.0.0.1", port=args.port,
                        served_model_name=args.served_model_name, api_keys=tuple(args.api_key),
                        log_level="warning")
    sys.exit(0 if served else 1)           # as ``kvhive serve``: 1 when the engine loop died


if __name__ == "__main__":
    _serve_main()
