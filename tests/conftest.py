"""Fixtures and hooks for the whole suite; the machinery they use lives in ``tests/support``.

Tests under ``tests/e2e`` get the ``e2e`` marker here. Nothing a passing run writes stays in the
system temp dir: tests write under ``tmp_path`` (removed once the test passes, the run's base temp
dir once the run passes: ``tmp_path_retention_policy`` in pyproject.toml), the subprocesses' logs go
to ``support.servers.log_file`` (under the run's base temp dir too), and the run's summary lists any
entry that appeared in the temp dir while it ran.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.redis_server import RedisServer, running_redis_server
from support.servers import (
    DEFAULT_API_KEY,
    TINY_API_KEY,
    TINY_MAX_MODEL_LEN,
    ServerProcess,
    set_log_dir,
    start_server,
    stop_server,
)

E2E_DIR = Path(__file__).parent / "e2e"

# Importing torch.nn.attention imports torch._dynamo, which makes its cache dir, by default
# $TMPDIR/torchinductor_$USER (kvhive compiles nothing with it): for the tests and the servers they
# start, that dir is one beside the kernels' cache instead.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "kvhive", "torchinductor"))


# ---------------------------------------------------------------- the temp dir stays clean

_TEMP_ENTRIES = pytest.StashKey[set[str]]()


@pytest.fixture(scope="session", autouse=True)
def _subprocess_log_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    set_log_dir(str(tmp_path_factory.mktemp("logs")))
    yield
    set_log_dir(None)


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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test under tests/e2e is ``e2e`` (it starts a server, redis-server or the gateway)."""
    for item in items:
        if E2E_DIR in item.path.parents:
            item.add_marker(pytest.mark.e2e)


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


@pytest.fixture()
def taken_port() -> Iterator[int]:
    """A port another socket listens on (the way another server holds it)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


# ---------------------------------------------------------------- redis-server


@pytest.fixture()
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own (skipped where none is installed, outside CI)."""
    with running_redis_server(str(tmp_path)) as server:
        yield server


@pytest.fixture(scope="module")
def module_redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server shared by the tests of one module."""
    with running_redis_server(str(tmp_path_factory.mktemp("redis"))) as server:
        yield server


@pytest.fixture(params=["disk", "redis"])
def persistence(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, tuple[str, ...]]]:
    """The tier sessions and stored responses persist with, and the server flags that configure it."""
    if request.param == "disk":
        yield "disk", ("--disk-cache-dir", str(tmp_path))
        return
    with running_redis_server(str(tmp_path)) as server:
        yield "redis", ("--redis-url", server.url)


# ---------------------------------------------------------------- the default model


@pytest.fixture(scope="session")
def tokenizer():  # -> kvhive.core.tokenizer.Tokenizer
    """The default model's tokenizer (read once per run; tokenizers are not changed by use)."""
    from kvhive.core.model_files import default_model_path
    from kvhive.core.tokenizer import Tokenizer

    return Tokenizer.from_model_path(default_model_path())


@pytest.fixture(scope="module")
def default_server() -> Iterator[ServerProcess]:
    """A server on the real default model (API key DEFAULT_API_KEY, 2048-token context), per module."""
    server = start_server("default", api_keys=(DEFAULT_API_KEY,), max_model_len=2048)
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def openai_client(default_server: ServerProcess):  # -> openai.OpenAI
    """The official ``openai`` client for ``default_server``."""
    from openai import OpenAI

    return OpenAI(base_url=f"{default_server.base_url}/v1", api_key=DEFAULT_API_KEY, max_retries=0, timeout=120)
