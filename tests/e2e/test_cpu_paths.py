"""The kernel path each ISA level takes, through the real ``kvhive serve`` and ``kvhive warmup``: the
servers below run the levels this host has, with ``--dtype bfloat16`` among them. The level rules
themselves: tests/unit/test_cpu_levels.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
from support.servers import REPO_ROOT, free_port, log_file, wait_healthy

from kvhive.model import cpu


def _serve(*args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = log_file(f"kvhive-cli-{port}-")
    proc = subprocess.Popen([sys.executable, "-m", "kvhive.cli", "serve", "--port", str(port),
                             "--kv-cache-gb", "0.1", *args], stdout=log, stderr=subprocess.STDOUT,
                            cwd=REPO_ROOT)
    return proc, f"http://127.0.0.1:{port}", log.name


def _wait_healthy(proc: subprocess.Popen, url: str, log: str, timeout_s: float = 300) -> None:
    assert wait_healthy(proc, url, log, timeout_s), "server did not start"


# The host's best level, and AVX2 when the host has more (what an AVX2-only CPU runs).
SERVED_LEVELS = list(dict.fromkeys([cpu.detect().best] + (["avx2"] if cpu.detect().supports("avx2") else [])))


@pytest.mark.parametrize("isa", SERVED_LEVELS)
def test_bfloat16_server_answers_coherently(isa: str) -> None:
    proc, url, log = _serve("--dtype", "bfloat16", "--cpu-isa", isa)
    try:
        _wait_healthy(proc, url, log)
        version = httpx.get(f"{url}/version", timeout=10).json()
        assert version["dtype"] == "bfloat16" and version["cpu_isa"] == isa
        paths = version["paths"]
        assert isa in paths["decode_attention"] and isa in paths["prefill_attention"], paths
        if not cpu.detect().bf16_packing(isa):
            assert not paths["projections"].startswith("oneDNN packed"), paths
        with open(log) as f:
            assert f"kernels for {isa}" in f.read()
        r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": "smollm2-135m", "max_tokens": 24, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        os.unlink(log)


def test_warmup_builds_the_kernels_for_the_hosts_level() -> None:
    out = subprocess.run([sys.executable, "-m", "kvhive.cli", "warmup"], capture_output=True, text=True,
                         cwd=REPO_ROOT, timeout=600)
    assert out.returncode == 0, out.stderr
    assert f"kernels for {cpu.detect().best}" in out.stdout
    assert out.stdout.count("ready") >= 3, out.stdout
