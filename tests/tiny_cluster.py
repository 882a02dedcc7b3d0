"""Tiny-model replicas on fixed ports and a ``kvhive gateway`` in front of them (real processes).

Usable by any test file (pytest puts tests/ on sys.path): ``from tiny_cluster import ...``. A
replica is ``tests/conftest.py --model tiny`` (random weights, the default model's tokenizer), so
it starts and generates fast; it keeps its port, so a replica killed with SIGKILL can be started
again where the gateway expects it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx
from conftest import REPO_ROOT, TESTS_DIR, TINY_MAX_MODEL_LEN, free_port, log_file
from test_gateway import Cluster, _env, healthy, wait_until

# gateway pid -> its log file
_gateway_logs: dict[int, str] = {}


@dataclass
class TinyReplica:
    """A tiny-model server on a fixed port."""

    api_keys: tuple[str, ...] = ()
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    log_path: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        log = log_file(f"kvhive-tiny-replica-{self.port}-")
        self.log_path = log.name
        cmd = [sys.executable, os.path.join(TESTS_DIR, "conftest.py"), "--model", "tiny",
               "--port", str(self.port), "--max-model-len", str(TINY_MAX_MODEL_LEN)]
        for key in self.api_keys:
            cmd += ["--api-key", key]
        self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=_env())

    def wait_healthy(self) -> None:
        def up() -> bool:
            assert self.alive, self.log_tail()
            return healthy(self.url)

        wait_until(up, 180, f"replica {self.url}")

    def kill(self) -> None:
        """SIGKILL: no graceful shutdown, connections cut as a crash cuts them."""
        if self.alive:
            assert self.process is not None
            self.process.kill()
            self.process.wait()

    def log_tail(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-3000:]


def start_gateway(replicas: Sequence[TinyReplica], *flags: str) -> Cluster:
    """A gateway in front of ``replicas`` (running), once it sees all of them up."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvhive.cli", "gateway", "--port", str(port), "--log-level", "warning",
           *flags]
    for r in replicas:
        cmd += ["--replica", r.url]
    log = log_file("kvhive-gateway-")
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=_env())
    _gateway_logs[process.pid] = log.name
    cluster = Cluster(list(replicas), f"http://127.0.0.1:{port}", process)  # type: ignore[arg-type]
    try:
        wait_until(lambda: healthy(cluster.gateway_url) and set(cluster.replica_states().values()) == {"up"},
                   60, "the gateway to see every replica")
    except BaseException:
        stop_gateway(cluster)
        raise
    return cluster


def stop_gateway(cluster: Cluster) -> None:
    """Stop the gateway and print the end of its log (shown for a failed test)."""
    cluster.gateway.terminate()
    try:
        cluster.gateway.wait(10)
    except subprocess.TimeoutExpired:
        cluster.gateway.kill()
        cluster.gateway.wait()
    with open(_gateway_logs.pop(cluster.gateway.pid), errors="replace") as f:
        print("gateway log tail:\n" + f.read()[-3000:])


def restore(cluster: Cluster) -> None:
    """Start every replica that is not running and wait until the gateway routes to all again."""
    for r in cluster.replicas:
        if not r.alive:                                     # type: ignore[attr-defined]
            r.start()
    for r in cluster.replicas:
        r.wait_healthy()
    wait_until(lambda: set(cluster.replica_states().values()) == {"up"}, 30, "the gateway to restore them")


@contextmanager
def tiny_replicas(n: int, api_keys: tuple[str, ...] = ()) -> Iterator[list[TinyReplica]]:
    """``n`` running tiny replicas, killed on exit."""
    replicas = [TinyReplica(api_keys) for _ in range(n)]
    try:
        for r in replicas:
            r.start()
        for r in replicas:
            r.wait_healthy()
        yield replicas
    finally:
        for r in replicas:
            r.kill()
        for r in replicas:
            if r.log_path:
                print(f"replica {r.url} log tail:\n{r.log_tail()}")


def gateway_metric(cluster: Cluster, name: str, labels: dict[str, str] | None = None) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0.0 when none)."""
    total = 0.0
    for line in httpx.get(f"{cluster.gateway_url}/metrics", timeout=10).text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if match and match.group(1) == name:
            found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
            if all(found.get(k) == v for k, v in (labels or {}).items()):
                total += float(match.group(3))
    return total
