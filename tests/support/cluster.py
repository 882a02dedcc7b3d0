"""Replicas and a ``kvhive gateway`` in front of them, as real processes on free ports.

A ``ReplicaProcess`` is ``kvhive serve`` on the default model publishing KV events over ZMQ; a
``TinyReplica`` is the test server on the tiny model (random weights, the default model's tokenizer),
so it starts and generates fast. Both keep their ports, so a replica killed with SIGKILL can be
started again where the gateway expects it. ``default_cluster`` is the usual pair: two default-model
replicas behind one gateway that drops a replica after one failed health check.
"""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import httpx
from support.servers import (
    REPO_ROOT,
    TINY_MAX_MODEL_LEN,
    free_port,
    healthy,
    log_file,
    log_tail,
    metric_samples,
    serve_command,
    subprocess_env,
    wait_until,
)

WORDS = ("alpha beta gamma delta epsilon zeta theta kappa lambda omicron sigma river mountain "
         "valley forest ocean desert garden castle bridge tower market harbor").split()


def long_prompt(seed: int, words: int = 220) -> str:
    """A prompt of ``words`` random words, the same for the same seed."""
    rng = random.Random(seed)
    return f"Document {seed}. " + " ".join(rng.choice(WORDS) for _ in range(words))


class Replica(Protocol):
    """What the gateway helpers need of a replica process."""

    url: str
    spec: str

    def start(self) -> None: ...
    def wait_healthy(self) -> None: ...
    def kill(self) -> None: ...


@dataclass
class _ReplicaBase:
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    log_path: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def _start(self, name: str, cmd: list[str]) -> None:
        log = log_file(f"kvhive-{name}-{self.port}-")
        self.log_path = log.name
        self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                        env=subprocess_env())

    def _wait_healthy(self, timeout_s: float) -> None:
        def up() -> bool:
            assert self.alive, self.log_tail()
            return healthy(self.url)

        wait_until(up, timeout_s, f"replica {self.url}")

    def kill(self) -> None:
        """SIGKILL: no graceful shutdown, connections cut as a crash cuts them."""
        if self.alive:
            assert self.process is not None
            self.process.kill()
            self.process.wait()

    def log_tail(self) -> str:
        """The end of the replica's log."""
        return log_tail(self.log_path)


@dataclass
class ReplicaProcess(_ReplicaBase):
    """A ``kvhive serve`` process on the default model, publishing KV events, on fixed ports."""

    events_port: int = field(default_factory=free_port)
    replay_port: int = field(default_factory=free_port)
    extra_args: tuple[str, ...] = ()

    @property
    def spec(self) -> str:
        """The gateway's ``--replica`` value: the URL and the event sockets."""
        return (f"{self.url},events=tcp://127.0.0.1:{self.events_port},"
                f"replay=tcp://127.0.0.1:{self.replay_port},kind=kvhive")

    def start(self) -> None:
        """Start it (not waiting for it)."""
        self._start("replica", [
            sys.executable, "-m", "kvhive.cli", "serve", "--port", str(self.port),
            "--max-model-len", "1024", "--kv-cache-gb", "0.2", "--num-threads", "1",
            "--log-level", "warning",
            "--kv-events", f"tcp://*:{self.events_port}",
            "--kv-events-replay", f"tcp://*:{self.replay_port}", *self.extra_args])

    def wait_healthy(self) -> None:
        """Wait until /health answers 200 (AssertionError with its log if it exits)."""
        self._wait_healthy(120)


@dataclass
class TinyReplica(_ReplicaBase):
    """The tiny-model test server on a fixed port."""

    api_keys: tuple[str, ...] = ()
    extra_args: tuple[str, ...] = ()        # more flags of the test server (``--faulty``, ``--http-*``, ``--max-request-bytes``)

    @property
    def spec(self) -> str:
        """The gateway's ``--replica`` value: the URL alone (no KV events)."""
        return self.url

    def start(self) -> None:
        """Start it (not waiting for it)."""
        args = ["--max-model-len", str(TINY_MAX_MODEL_LEN), *self.extra_args]
        for key in self.api_keys:
            args += ["--api-key", key]
        self._start("tiny-replica", serve_command("tiny", self.port, *args))

    def wait_healthy(self) -> None:
        """Wait until /health answers 200 (AssertionError with its log if it exits)."""
        self._wait_healthy(180)


@dataclass
class Cluster:
    """A gateway process in front of ``replicas``."""

    replicas: list
    gateway_url: str
    gateway: subprocess.Popen[bytes]
    gateway_log: str = ""

    def client(self) -> httpx.Client:
        """An HTTP client for the gateway."""
        return httpx.Client(base_url=self.gateway_url, timeout=60)

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        """The gateway's first sample of ``name`` whose labels include ``labels`` (0.0 when none)."""
        samples = metric_samples(httpx.get(f"{self.gateway_url}/metrics", timeout=10).text, name, labels)
        return samples[0] if samples else 0.0

    def metric_sum(self, name: str, labels: dict[str, str] | None = None) -> float:
        """The sum of the gateway's samples of ``name`` whose labels include ``labels``."""
        return sum(metric_samples(httpx.get(f"{self.gateway_url}/metrics", timeout=10).text, name, labels))

    def replica_states(self) -> dict[str, str]:
        """Each replica's state as the gateway's /health tells it."""
        return httpx.get(f"{self.gateway_url}/health", timeout=5).json()["replicas"]


def start_gateway(replicas: Sequence[Replica], *flags: str, until_all_up: bool = True) -> Cluster:
    """A gateway in front of ``replicas`` (running), once it is healthy and, with ``until_all_up``,
    sees every replica up."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvhive.cli", "gateway", "--port", str(port), "--log-level", "warning",
           *flags]
    for r in replicas:
        cmd += ["--replica", r.spec]
    log = log_file("kvhive-gateway-")
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=subprocess_env())
    cluster = Cluster(list(replicas), f"http://127.0.0.1:{port}", process, log.name)
    try:
        if until_all_up:
            wait_until(lambda: healthy(cluster.gateway_url) and set(cluster.replica_states().values()) == {"up"},
                       60, "the gateway to see every replica")
        else:
            wait_until(lambda: healthy(cluster.gateway_url), 60, f"gateway {flags}")
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
    print("gateway log tail:\n" + log_tail(cluster.gateway_log))


def restore(cluster: Cluster) -> None:
    """Start every replica that is not running and wait until the gateway routes to all again."""
    for r in cluster.replicas:
        if not r.alive:
            r.start()
    for r in cluster.replicas:
        r.wait_healthy()
    wait_until(lambda: set(cluster.replica_states().values()) == {"up"}, 30, "the gateway to restore them")


@contextmanager
def running_replicas(replicas: list, print_logs: bool = True) -> Iterator[list]:
    """Start ``replicas``, wait until all answer, kill them on exit (printing their log tails)."""
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
            if print_logs and r.log_path:
                print(f"replica {r.url} log tail:\n{r.log_tail()}")


@contextmanager
def tiny_replicas(n: int, api_keys: tuple[str, ...] = ()) -> Iterator[list[TinyReplica]]:
    """``n`` running tiny replicas, killed on exit."""
    with running_replicas([TinyReplica(api_keys=api_keys) for _ in range(n)]) as replicas:
        yield replicas


@contextmanager
def default_cluster(*replica_args: str, print_replica_logs: bool = False) -> Iterator[Cluster]:
    """Two default-model replicas (``replica_args``: more ``kvhive serve`` flags) behind a gateway
    that checks health every 0.3 s and drops a replica after one failure; all stopped on exit."""
    replicas = [ReplicaProcess(extra_args=replica_args) for _ in range(2)]
    with running_replicas(replicas, print_logs=print_replica_logs):
        # Started once the replicas answer, so it reads their fingerprint from /v1/models.
        cluster = start_gateway(replicas, "--health-interval", "0.3", "--failures-to-drop", "1")
        try:
            yield cluster
        finally:
            stop_gateway(cluster)
