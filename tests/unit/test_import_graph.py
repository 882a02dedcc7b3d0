"""The scheduler side stays torch-free and never imports the runner or the model."""

from __future__ import annotations

import json
import subprocess
import sys

TORCH_FREE = ["kvhive.engine.scheduler", "kvhive.kv.pool", "kvhive.kv.manager", "kvhive.core.blocks",
              "kvhive.store.tiered", "kvhive.store.disk", "kvhive.store.memory", "kvhive.store.redis",
              "kvhive.core.tokenizer", "kvhive.engine.step", "kvhive.request", "kvhive.config", "kvhive.sessions.registry",
              "kvhive.sessions.responses", "kvhive.store.redis_guard"]
FORBIDDEN = ("torch", "kvhive.engine.runner", "kvhive.model")


def test_scheduler_side_imports_no_torch_runner_or_model():
    code = (
        "import importlib, json, sys\n"
        f"for name in {TORCH_FREE!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout)
    bad = [m for m in loaded if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]
    assert bad == []
