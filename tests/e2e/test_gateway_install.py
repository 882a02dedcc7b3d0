"""The gateway installs and runs without torch: ``pip install`` of kvhive with no extra into a fresh
virtual environment (its dependencies from the package index) brings no torch, ``kvhive gateway``
starts through the console script and routes a request to a replica (the replica simulator), and
``kvhive serve`` says which extra it needs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.servers import REPO_ROOT, free_port, healthy, log_file, log_tail, subprocess_env, wait_until

from kvhive.core.model_files import default_model_path

pytestmark = pytest.mark.slow

# pip's words for an index it cannot reach: the test then skips instead of failing.
OFFLINE_SIGNS = ("NewConnectionError", "Temporary failure in name resolution", "Network is unreachable",
                 "Max retries exceeded")


def clean_env() -> dict[str, str]:
    """This process's environment without what would let the venv's Python see other packages."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


@pytest.fixture(scope="module")
def gateway_venv(tmp_path_factory) -> Iterator[Path]:
    """A fresh venv (no system site-packages) holding kvhive installed with no extra."""
    root = tmp_path_factory.mktemp("gateway-install")
    source = root / "src"       # a copy of what the build reads, so the build writes nothing in the repo
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO_ROOT, name), source / name)
    shutil.copytree(os.path.join(REPO_ROOT, "kvhive"), source / "kvhive",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env_dir = root / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False).create(env_dir)
    install = subprocess.run([str(env_dir / "bin" / "python"), "-m", "pip", "install", "--quiet",
                              "--disable-pip-version-check", str(source)],
                             capture_output=True, text=True, cwd=root, env=clean_env())
    if install.returncode != 0:
        if any(sign in install.stdout + install.stderr for sign in OFFLINE_SIGNS):
            pytest.skip("no package index reachable for the gateway's dependencies")
        raise AssertionError(f"pip install failed:\n{install.stdout[-3000:]}\n{install.stderr[-3000:]}")
    yield env_dir


def run_in(env_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """A command of the venv, run outside the repository with the venv's packages only."""
    return subprocess.run([str(env_dir / "bin" / args[0]), *args[1:]], capture_output=True, text=True,
                          cwd=env_dir, env=clean_env(), timeout=120)


def test_the_base_install_has_no_torch_and_serve_names_its_extra(gateway_venv: Path) -> None:
    for module in ("torch", "gguf", "safetensors"):
        probe = run_in(gateway_venv, "python", "-c", f"import {module}")
        assert probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr, module
    for command in ("serve", "warmup"):
        refused = run_in(gateway_venv, "kvhive", command)
        assert refused.returncode == 2
        assert "pip install 'kvhive[server]'" in refused.stderr
        assert "Traceback" not in refused.stderr


def test_the_gateway_runs_from_the_base_install(gateway_venv: Path) -> None:
    replica_port, events_port, gateway_port = free_port(), free_port(), free_port()
    while events_port + 1 in (replica_port, gateway_port):
        events_port = free_port()
    replica_log, gateway_log = log_file("replica-sim-"), log_file("gateway-install-")
    replica = subprocess.Popen([sys.executable, os.path.join(REPO_ROOT, "bench", "replica_sim.py"),
                                "--replicas", "1", "--port", str(replica_port),
                                "--events-port", str(events_port)],
                               stdout=replica_log, stderr=subprocess.STDOUT, env=subprocess_env(), cwd=REPO_ROOT)
    gateway = None
    try:
        replica_url = f"http://127.0.0.1:{replica_port}"
        wait_until(lambda: healthy(replica_url), 60, "the replica simulator answers /health")
        spec = f"{replica_url},events=tcp://127.0.0.1:{events_port},replay=tcp://127.0.0.1:{events_port + 1}"
        gateway = subprocess.Popen([str(gateway_venv / "bin" / "kvhive"), "gateway", "--port", str(gateway_port),
                                    "--replica", spec, "--model", default_model_path()],
                                   stdout=gateway_log, stderr=subprocess.STDOUT, env=clean_env(),
                                   cwd=gateway_venv)
        gateway_url = f"http://127.0.0.1:{gateway_port}"
        wait_until(lambda: gateway.poll() is not None or healthy(gateway_url), 60, "the gateway answers /health")
        assert gateway.poll() is None, log_tail(gateway_log.name)
        health = httpx.get(f"{gateway_url}/health", timeout=10).json()
        assert health["replicas"] == {replica_url: "up"}
        r = httpx.post(f"{gateway_url}/v1/completions", timeout=30,
                       json={"model": "smollm2-135m", "prompt": "Hello there", "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
    finally:
        for process in (gateway, replica):
            if process is not None:
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
        replica_log.close()
        gateway_log.close()
