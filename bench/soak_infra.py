"""The processes and files a soak drill runs against: kvhive replicas, a redis-server it can stall,
a small tmpfs it can fill, and what a replica reports on /metrics.

Each piece is a context manager (or has ``stop``) so that the drill leaves nothing behind on an
error or Ctrl-C: servers stopped, Redis resumed and stopped, the tmpfs unmounted.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

METRIC_LINE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$")
# The gauges the drill samples; any gauge of open connections a replica exports is added.
SAMPLED = {"kvhive_kv_blocks", "kvhive_sessions_live", "kvhive_responses_stored", "kvhive_kv_cache_usage_perc",
           "kvhive_num_requests_running", "kvhive_num_requests_waiting", "kvhive_session_blocks",
           "kvhive_kv_tier_errors_total", "kvhive_kv_tier_usage_bytes"}
# Gauges that must read at the end of a drill what they read before it (once the sessions left
# alive are gone): nothing still running, waiting, held or open.
BASELINE = ("kvhive_kv_blocks{state=used}", "kvhive_sessions_live", "kvhive_responses_stored",
            "kvhive_num_requests_running", "kvhive_num_requests_waiting")


def is_connection_gauge(name: str) -> bool:
    return name.startswith("kvhive_") and "connections" in name and not name.endswith(("_total", "_created"))


def baseline_keys(metrics: dict[str, float]) -> list[str]:
    """The sampled keys that must return to their value before the drill."""
    return [*BASELINE, *sorted(k for k in metrics if k.startswith("kvhive_session_blocks")
                               or is_connection_gauge(k.split("{")[0]))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float | None:
    """Resident set size of a process in MB (/proc), None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def parse_metrics(text: str) -> dict[str, float]:
    """The sampled series of a /metrics page, keyed ``name{label=value,...}`` (model_name dropped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = METRIC_LINE.match(line)
        if not match or not (match.group(1) in SAMPLED or is_connection_gauge(match.group(1))):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        labels.pop("model_name", None)
        suffix = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        out[f"{match.group(1)}{{{suffix}}}" if suffix else match.group(1)] = float(match.group(3))
    return out


class Replica:
    """One ``kvhive serve`` process on a fixed port, started (and restarted) with one command line."""

    def __init__(self, name: str, args: list[str], log_path: str, cwd: str) -> None:
        self.name = name
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "kvhive.cli", "serve", "--port", str(self.port), "--log-level", "warning",
                    *args]
        self.log_path, self.cwd = log_path, cwd
        self.process: subprocess.Popen[bytes] | None = None
        self.exit_codes: list[int] = []
        open(log_path, "w").close()

    def start(self, timeout_s: float = 600) -> float:
        """Start the server and wait until /health answers; the seconds that took."""
        print("+", shlex.join(self.cmd), flush=True)
        with open(self.log_path, "a") as log:
            self.process = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, cwd=self.cwd)
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name}: the server exited with {self.process.returncode} while starting "
                                   f"(log: {self.log_path})")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return time.monotonic() - start
            time.sleep(0.5)
        raise RuntimeError(f"{self.name}: the server was not healthy after {timeout_s:.0f} s")

    def stop(self) -> None:
        """SIGTERM (requests in flight finish), SIGKILL after 60 s; the exit code is kept."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.exit_codes.append(self.process.wait(timeout=60))
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.exit_codes.append(self.process.wait())

    def restart(self) -> tuple[float, float]:
        """Stop, start again; (seconds to stop, seconds until healthy)."""
        start = time.monotonic()
        self.stop()
        stopped = time.monotonic() - start
        return stopped, self.start()

    def healthy(self) -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{self.base_url}/health", timeout=10).status_code == 200
        return False

    def snapshot(self) -> dict[str, Any]:
        """RSS and sampled gauges now (gauges empty while the server is down)."""
        pid = self.process.pid if self.process else -1
        try:
            metrics = parse_metrics(httpx.get(f"{self.base_url}/metrics", timeout=30).text)
        except httpx.HTTPError:
            metrics = {}
        return {"rss_mb": rss_mb(pid), "metrics": metrics}

    def drain(self, timeout_s: float) -> float | None:
        """Seconds until no session, stored response or used block is left (their TTLs ran out);
        None when some still are after ``timeout_s``."""
        start = time.monotonic()
        while True:
            metrics = self.snapshot()["metrics"]
            if metrics and all(metrics.get(k, 0.0) == 0.0 for k in BASELINE[:3]):
                return time.monotonic() - start
            if time.monotonic() - start > timeout_s:
                return None
            time.sleep(2)


class RedisServer:
    """A redis-server on a port, without persistence; ``stall`` stops it (SIGSTOP) for a while, then
    flushes it."""

    def __init__(self, port: int, log_path: str) -> None:
        import redis

        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.log = open(log_path, "w")            # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no",
                                         "--bind", "127.0.0.1"], stdout=self.log, stderr=subprocess.STDOUT)
        self.client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)
        for _ in range(100):
            with contextlib.suppress(redis.ConnectionError):
                if self.client.ping():
                    return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {port}")

    def stall(self, stop_s: float, note: Any) -> None:
        """SIGSTOP for ``stop_s`` seconds, SIGCONT, FLUSHALL; ``note(event)`` at each step."""
        note("redis SIGSTOP")
        self.process.send_signal(signal.SIGSTOP)
        try:
            time.sleep(stop_s)
        finally:
            self.process.send_signal(signal.SIGCONT)
        note("redis SIGCONT")
        self.client.flushall()
        note("redis FLUSHALL")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.terminate()
            self.process.wait(timeout=10)
        self.log.close()


class SmallDisk:
    """A tmpfs of ``size_mb`` mounted on a fresh directory for the replicas' disk cache dirs;
    ``fill`` makes it full (shrunk to what it holds, the rest filled), ``unfill`` undoes that. Mounting needs
    root (or ``unshare -rm``): without it the drill stops with a clear error, it never falls back
    to a directory on a disk it cannot fill safely."""

    FILLER = "filler.bin"

    def __init__(self, size_mb: int) -> None:
        self.size_mb = size_mb
        self.path = tempfile.mkdtemp(prefix="kvhive-soak-disk-")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "kvhive-soak", self.path],
                              capture_output=True, text=True)
        if done.returncode != 0:
            os.rmdir(self.path)
            raise PermissionError(f"cannot mount a {size_mb} MB tmpfs for the full-disk fault ({done.stderr.strip()}); "
                                  "run the drill as root or under 'unshare -rm'")

    def subdir(self, name: str) -> str:
        path = os.path.join(self.path, name)
        os.makedirs(path, exist_ok=True)
        return path

    def free_bytes(self) -> int:
        stat = os.statvfs(self.path)
        return stat.f_bavail * stat.f_frsize

    def fill(self) -> int:
        """Make the tmpfs full at once: shrink it to what it holds now (a remount), then write zeros
        into what rounding left until ENOSPC; the bytes that were free before."""
        free = self.free_bytes()
        for _ in range(20):                     # the replicas may write between the look and the remount
            stat = os.statvfs(self.path)
            used_kb = (stat.f_blocks - stat.f_bfree) * stat.f_frsize // 1024
            if self.remount(f"{used_kb}k"):
                break
            time.sleep(0.05)
        else:
            raise RuntimeError(f"could not shrink the tmpfs at {self.path} to what it holds")
        with open(os.path.join(self.path, self.FILLER), "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
        return free

    def unfill(self) -> None:
        """Remove the filler and give the tmpfs its size back."""
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(self.path, self.FILLER))
        if not self.remount(f"{self.size_mb}m"):
            raise RuntimeError(f"could not give the tmpfs at {self.path} its {self.size_mb} MB back")

    def remount(self, size: str) -> bool:
        return subprocess.run(["mount", "-o", f"remount,size={size}", self.path], capture_output=True).returncode == 0

    def close(self) -> None:
        with contextlib.suppress(RuntimeError):
            self.unfill()
        done = subprocess.run(["umount", self.path], capture_output=True, text=True)
        if done.returncode != 0:
            subprocess.run(["umount", "-l", self.path], capture_output=True, text=True)
        with contextlib.suppress(OSError):
            os.rmdir(self.path)
