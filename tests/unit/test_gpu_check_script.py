"""The prepared GPU check (bench/gpu_check.sh, bench/gpu_decode.py) stays runnable without a GPU:
the shell script parses, and gpu_decode.py's smoke mode builds its dummy model on CPU, times it
through the runner and writes its JSON and table with the floors and the targets."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from support.servers import REPO_ROOT, subprocess_env


def test_the_shell_script_parses() -> None:
    script = os.path.join(REPO_ROOT, "bench", "gpu_check.sh")
    proc = subprocess.run(["bash", "-n", script], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def test_gpu_decode_smoke_run_writes_its_results(tmp_path) -> None:
    proc = subprocess.run([sys.executable, os.path.join("bench", "gpu_decode.py"), "--device", "cpu", "--smoke",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
                          env=subprocess_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "gpu_decode.json").read_text())
    assert record["fingerprint"].startswith("dummy-")
    assert record["floors"]["hbm_bytes_per_s"] > 0 and record["floors"]["matmul_flop_per_s"] > 0
    decodes = [c for c in record["cases"] if c["kind"] == "decode"]
    assert {(c["batch"], c["context"]) for c in decodes} == {(1, 64), (2, 64), (1, 128), (2, 128)}
    for case in record["cases"]:
        assert case["backend"] == "torch" and case["step_ms"] > 0 and case["floor_ms"] > 0
        assert case["attention"]["decode_attention"].startswith("torch")
    # Each floor grows with what the step must read or compute.
    by_shape = {(c["batch"], c["context"]): c for c in decodes}
    assert by_shape[2, 128]["bytes_read"] > by_shape[1, 128]["bytes_read"] > by_shape[1, 64]["bytes_read"]
    # No paged (triton) case ran: both targets say so rather than met or missed.
    assert {t["status"] for t in record["targets"].values()} == {"not measured"}
    table = (tmp_path / "gpu_decode.md").read_text()
    assert "| decode | torch | 2 | 128 |" in table and "not measured" in table
    assert os.path.isfile(tmp_path / "smoke_shape" / "config.json")


def _decode(backend: str, batch: int, context: int, step_ms: float, floor_ms: float) -> dict:
    return {"kind": "decode", "backend": backend, "batch": batch, "context": context, "step_ms": step_ms,
            "floor_ms": floor_ms, "x_floor": step_ms / floor_ms}


def test_the_targets_are_judged_at_batch_32_and_8k() -> None:
    from gpu_decode import evaluate_targets

    met = evaluate_targets([_decode("triton", 32, 8192, 14.0, 10.0), _decode("torch", 32, 8192, 30.0, 10.0),
                            _decode("triton", 1, 8192, 9.0, 8.0), _decode("torch", 1, 8192, 10.0, 8.0)])
    assert met["decode_floor"]["status"] == "met" and met["paged_vs_gather"]["status"] == "met"
    assert met["paged_vs_gather"]["speedups"] == {"batch 32": 30.0 / 14.0, "batch 1": 10.0 / 9.0}
    missed = evaluate_targets([_decode("triton", 32, 8192, 16.0, 10.0), _decode("torch", 32, 8192, 24.0, 10.0)])
    assert missed["decode_floor"]["status"] == "missed" and missed["paged_vs_gather"]["status"] == "missed"
    gather_only = evaluate_targets([_decode("torch", 32, 8192, 24.0, 10.0),
                                    {"kind": "backend", "backend": "triton", "skipped": "unavailable"}])
    assert {t["status"] for t in gather_only.values()} == {"not measured"}


def test_the_profiler_window_records_other_threads_ops(tmp_path) -> None:
    import threading
    import time

    import torch
    from profiled_serve import profile_window

    go = threading.Event()

    def work() -> None:                          # a thread that runs before the window opens, as the engine's
        x = torch.ones(64, 64)
        go.wait(60)
        for _ in range(20):
            x = torch.mm(x, x) / 64

    worker = threading.Thread(target=work)
    worker.start()
    trace = str(tmp_path / "trace.json")
    window = threading.Thread(target=profile_window, args=(trace, str(tmp_path)))
    window.start()
    (tmp_path / "start").touch()
    deadline = time.monotonic() + 60
    while not os.path.exists(trace + ".started") and time.monotonic() < deadline:
        time.sleep(0.05)
    go.set()
    worker.join()
    (tmp_path / "stop").touch()
    window.join(timeout=60)
    assert os.path.exists(trace + ".done")
    names = {e.get("name") for e in json.loads(open(trace).read())["traceEvents"]}
    assert "aten::mm" in names
