"""Triton kernels checked on CPU: a test module's kernel tests run under Triton's interpreter.

The interpreter takes over only when ``TRITON_INTERPRET=1`` is set before ``triton`` itself is first
imported in the process (its standard library is decorated at import time), and a process cannot
import triton twice. So a kernel test module marks its tests ``interpreted`` (they run only in a
process started with the variable) and adds one ``interpreter_run_passes`` test, which, in a process
without it, runs the same module in a child pytest with the variable set and asserts that it passed:

    TRITON_INTERPRET=1 PYTHONPATH=$PWD python -m pytest -q tests/unit/test_triton_decode.py

runs the kernel tests directly; without the variable, the same command runs them in the child.
Both skip where triton is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
# The kernel tests proper: only in a process started with TRITON_INTERPRET=1 (and triton installed).
interpreted = pytest.mark.skipif(not (HAS_TRITON and INTERPRETING),
                                 reason="runs in the child pytest started with TRITON_INTERPRET=1")


def interpreter_run_passes(test_file: str, min_passed: int = 1, timeout_s: float = 300.0) -> None:
    """Run ``test_file``'s tests in a child pytest with ``TRITON_INTERPRET=1``; fail with its output
    unless every test there passed and at least ``min_passed`` ran (skipped where this process
    interprets already or lacks triton)."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    if INTERPRETING:
        pytest.skip("this process runs the kernel tests itself")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
                          cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, f"{test_file} under TRITON_INTERPRET=1:\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}"
    passed = re.search(r"(\d+) passed", done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "")
    assert passed and int(passed.group(1)) >= min_passed, done.stdout[-2000:]      # the cases ran, not skipped
