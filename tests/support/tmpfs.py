"""A small tmpfs for tests of a full disk: ``mount -t tmpfs`` where the test runs as root, else in
a mount namespace of its own (``unshare -m``, then ``unshare -Urm``), else a skip with the reason.

In a namespace, a holder process keeps the mount alive; this process reaches the filesystem
through ``/proc/<holder>/root`` and starts a process inside it with ``command_prefix``
(``nsenter``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class SmallTmpfs:
    """A mounted tmpfs: ``path`` as this process reaches it, ``inner_path`` as a process started
    with ``command_prefix`` sees it."""

    path: str
    inner_path: str
    command_prefix: tuple[str, ...] = ()

    def free_bytes(self) -> int:
        """Bytes still free on the filesystem."""
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def fill(self, name: str = "filler", leave_bytes: int = 0) -> str:
        """Write a file that takes all free room but ``leave_bytes``; its path."""
        path = os.path.join(self.path, name)
        with open(path, "ab") as f:
            chunk = b"\0" * 65536
            while self.free_bytes() > leave_bytes:
                try:
                    f.write(chunk[:max(4096, min(len(chunk), self.free_bytes() - leave_bytes))])
                    f.flush()
                except OSError:
                    break
        return path


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def _plain_mount(directory: str, size_bytes: int) -> Iterator[SmallTmpfs | str]:
    result = _run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", directory])
    if result.returncode != 0:
        yield f"mount: {result.stderr.strip()}"
        return
    try:
        yield SmallTmpfs(directory, directory)
    finally:
        _run(["umount", "-l", directory])


@contextlib.contextmanager
def _namespace_mount(directory: str, size_bytes: int, user_ns: bool) -> Iterator[SmallTmpfs | str]:
    unshare = ["unshare", "-Urm"] if user_ns else ["unshare", "-m", "--propagation", "private"]
    script = f"mount -t tmpfs -o size={size_bytes} tmpfs '{directory}' && echo ready && exec sleep 86400"
    holder = subprocess.Popen([*unshare, "sh", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    assert holder.stdout is not None
    if holder.stdout.readline().strip() != "ready":
        holder.kill()
        _, err = holder.communicate()
        yield f"{' '.join(unshare)}: {err.strip()}"
        return
    try:
        enter = ["nsenter", "-t", str(holder.pid), "-m"]
        if user_ns:
            enter = ["nsenter", "-t", str(holder.pid), "-U", "-m", "--preserve-credentials"]
        yield SmallTmpfs(f"/proc/{holder.pid}/root{directory}", directory, tuple(enter))
    finally:
        holder.kill()
        holder.wait()


@contextlib.contextmanager
def small_tmpfs(directory: str, size_bytes: int) -> Iterator[SmallTmpfs]:
    """A tmpfs of ``size_bytes`` on ``directory`` (made if missing) for the context's lifetime;
    the test is skipped, with each way's reason, when none can mount one."""
    os.makedirs(directory, exist_ok=True)
    reasons = []
    ways = []
    if os.geteuid() == 0:
        ways.append(lambda: _plain_mount(directory, size_bytes))
    if shutil.which("unshare") and shutil.which("nsenter"):
        if os.geteuid() == 0:
            ways.append(lambda: _namespace_mount(directory, size_bytes, user_ns=False))
        ways.append(lambda: _namespace_mount(directory, size_bytes, user_ns=True))
    else:
        reasons.append("unshare/nsenter not installed")
    for way in ways:
        with way() as mounted:
            if isinstance(mounted, SmallTmpfs):
                yield mounted
                return
            reasons.append(mounted)
    pytest.skip("cannot mount a small tmpfs: " + "; ".join(reasons or ["not root"]))
