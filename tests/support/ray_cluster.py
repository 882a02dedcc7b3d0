"""A multi-node Ray cluster on this machine for the Ray Serve tests: a head node and a second node
(``ray start``), small in CPUs and object-store memory, torn down with ``ray stop`` however the test
ends; and ``serve run`` of a config file as a subprocess."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import yaml
from support.servers import REPO_ROOT, free_port, log_file, log_tail, subprocess_env

OBJECT_STORE_BYTES = 80_000_000     # Ray's minimum is 75 MB
REPLICA_PROCESS = "ServeReplica:kvhive:KVHiveReplica"


@dataclass(frozen=True)
class RayCluster:
    """A running local cluster: its GCS address, environment for drivers, and temp dir."""

    address: str
    env: dict[str, str]
    temp_dir: str


def _ray(args: list[str], env: dict[str, str], log: IO[bytes]) -> None:
    """Run ``ray ARGS`` to completion (its output to ``log``)."""
    subprocess.run(["ray", *args], env=env, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=120)


@contextlib.contextmanager
def ray_cluster(num_nodes: int = 2, cpus_per_node: int = 1) -> Iterator[RayCluster]:
    """``num_nodes`` Ray nodes on loopback with ``cpus_per_node`` CPUs each; stopped on exit."""
    temp_dir = tempfile.mkdtemp(prefix="kvray")      # short: Ray's socket paths live under it
    port = free_port()
    env = subprocess_env({"RAY_USAGE_STATS_ENABLED": "0", "RAY_ADDRESS": f"127.0.0.1:{port}"})
    common = ["--node-ip-address=127.0.0.1", f"--num-cpus={cpus_per_node}",
              f"--object-store-memory={OBJECT_STORE_BYTES}"]
    log = log_file("ray-cluster")
    try:
        _ray(["start", "--head", f"--port={port}", "--include-dashboard=false", "--disable-usage-stats",
              f"--temp-dir={temp_dir}", *common], env, log)
        for _ in range(num_nodes - 1):
            _ray(["start", f"--address=127.0.0.1:{port}", *common], env, log)
        yield RayCluster(f"127.0.0.1:{port}", env, temp_dir)
    finally:
        subprocess.run(["ray", "stop", "--force"], env=env, stdout=log, stderr=subprocess.STDOUT, timeout=120)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def write_config(path: str, port: int, **args: Any) -> str:
    """examples/ray/config.yaml with the HTTP port ``port`` and ``args`` over its application's
    args (a value of None removes the field); its path."""
    with open(os.path.join(REPO_ROOT, "examples", "ray", "config.yaml")) as f:
        config = yaml.safe_load(f)
    config["http_options"]["port"] = port
    app_args = config["applications"][0]["args"]
    for name, value in args.items():
        app_args.pop(name, None) if value is None else app_args.__setitem__(name, value)
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    return path


@dataclass
class ServeRun:
    """A ``serve run CONFIG`` process and its log."""

    process: subprocess.Popen
    log_path: str

    def output(self) -> str:
        """What it printed so far (the end)."""
        return log_tail(self.log_path, 20_000)


# How long an interrupted ``serve run`` may take to delete its application before it is killed.
SERVE_RUN_EXIT_S = 20


@contextlib.contextmanager
def serve_run(cluster: RayCluster, config_path: str) -> Iterator[ServeRun]:
    """``serve run config_path`` against ``cluster`` (from the repository root); interrupted on exit,
    which deletes the application (killed when that takes longer than SERVE_RUN_EXIT_S: the
    cluster is stopped with ``ray stop --force`` after its module anyway)."""
    log = log_file("serve-run")
    process = subprocess.Popen(["serve", "run", config_path, "--address", cluster.address], cwd=REPO_ROOT,
                               env=cluster.env, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield ServeRun(process, log.name)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=SERVE_RUN_EXIT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        log.close()


def replica_pids() -> list[int]:
    """Process ids of the kvhive engine replicas Ray runs (by their process title)."""
    found = subprocess.run(["pgrep", "-f", REPLICA_PROCESS], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


def wait_for_app(run: ServeRun, client: Any, replicas: int = 2) -> None:
    """Wait until the application behind ``client`` (an ``httpx.Client``) answers /v1/models and Ray
    runs ``replicas`` kvhive replica processes; fail with ``run``'s output if it exits first or
    either takes too long."""
    import httpx
    from support.servers import wait_until

    def ready() -> bool:
        assert run.process.poll() is None, run.output()
        try:
            return client.get("/v1/models").status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(ready, 240, "the Ray Serve application answering /v1/models")
        wait_until(lambda: len(replica_pids()) == replicas, 60, f"{replicas} kvhive replica processes")
    except AssertionError as exc:       # say why: what `serve run` printed
        raise AssertionError(f"{exc}; `serve run` printed:\n{run.output()}") from None
