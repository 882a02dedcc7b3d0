"""Layering: the torch-free parts of kvhive import neither torch nor the layers above them.

Each case imports its modules in a fresh interpreter and lists what that loaded; a loaded module is
forbidden when it is one of the case's prefixes or inside one (``torch`` forbids ``torch.nn`` too).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.servers import REPO_ROOT, subprocess_env

# What the engine package never imports, at import time or inside a function.
ENGINE_CLIENTS = ("kvhive.sessions", "kvhive.server", "kvhive.launch")
ABOVE_THE_ROUTER = ("torch", "kvhive.model", "kvhive.engine", "kvhive.server", "kvhive.sessions")

CASES = {
    # The scheduler side: block pool, KV manager, stores, sessions, requests, config.
    "scheduler-side": (
        ["kvhive.engine.scheduler", "kvhive.kv.pool", "kvhive.kv.manager", "kvhive.core.blocks",
         "kvhive.store.tiered", "kvhive.store.disk", "kvhive.store.memory", "kvhive.store.redis",
         "kvhive.core.tokenizer", "kvhive.engine.step", "kvhive.request", "kvhive.config",
         "kvhive.sessions.registry", "kvhive.sessions.response_store", "kvhive.store.redis_guard"],
        ("torch", "kvhive.engine.runner", "kvhive.model")),
    # KV events and the router import only the torch-free blocks and events modules.
    "events-and-router": (
        ["kvhive.kv.events", "kvhive.router", "kvhive.router.app", "kvhive.router.cli",
         "kvhive.router.ingest", "kvhive.router.index", "kvhive.router.scorer",
         "kvhive.router.tokenize", "kvhive.router.gateway", "kvhive.router.discovery",
         "kvhive.router.redis_link", "kvhive.core.replica_registry"],
        ABOVE_THE_ROUTER),
    # What ``kvhive gateway`` imports, from the console script's module on.
    "gateway": (
        ["kvhive.cli", "kvhive.router.app", "kvhive.router.cli", "kvhive.core.tenancy",
         "kvhive.core.http_protocol"],
        ABOVE_THE_ROUTER),
    # The builder of the KV tiers and the record backends sits below the engine and the server.
    "durable-state": (
        ["kvhive.sessions.durable", "kvhive.store.tier_builder"],
        ("torch", "kvhive.model", "kvhive.engine", "kvhive.server", "kvhive.launch")),
    # The engine is handed its tiers (``kvhive.launch``): it imports no layer that builds or serves it.
    "engine": (
        ["kvhive.engine.llm_engine", "kvhive.engine.async_engine", "kvhive.engine.client",
         "kvhive.engine.assembly"],
        ENGINE_CLIENTS),
    # The tokenizer and chat template are kvhive's own, not transformers'.
    "tokenizer": (
        ["kvhive.core.tokenizer", "kvhive.core.chat_template", "kvhive.core.model_files"],
        ("torch", "transformers")),
    # The Ray application's router and ingress run in the ingress process: torch-free, no engine.
    "ray-router": (
        ["kvhive.integrations.ray", "kvhive.integrations.ray.router", "kvhive.integrations.ray.ingress"],
        ABOVE_THE_ROUTER),
    # The grammar backend (structured outputs) is torch-free and below the engine and the server.
    "structured": (
        ["kvhive.structured", "kvhive.structured.compiler", "kvhive.structured.grammars",
         "kvhive.structured.vocab", "kvhive.structured.errors"],
        ("torch", "kvhive.engine", "kvhive.model", "kvhive.server", "kvhive.sessions")),
    # The connector's scheduler half (lookups, transfer plans) leaves tensors to its worker half.
    "connector-scheduler-half": (
        ["kvhive.connector.offload", "kvhive.connector.base", "kvhive.engine.scheduler"],
        ("torch", "kvhive.model", "kvhive.engine.runner", "kvhive.connector.offload_worker")),
}


def loaded_modules(modules: list[str]) -> list[str]:
    """Every module in sys.modules after a fresh interpreter imports ``modules``."""
    code = ("import importlib, json, sys\n"
            f"for name in {modules!r}:\n"
            "    importlib.import_module(name)\n"
            "print(json.dumps(sorted(sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=REPO_ROOT, env=subprocess_env())
    return json.loads(out.stdout)


@pytest.mark.parametrize("modules,forbidden", list(CASES.values()), ids=list(CASES))
def test_imports_nothing_forbidden(modules: list[str], forbidden: tuple[str, ...]) -> None:
    if any(m.startswith("kvhive.integrations.ray") for m in modules):
        pytest.importorskip("ray.serve")
    loaded = loaded_modules(modules)
    assert set(modules) <= set(loaded)
    assert [m for m in loaded if any(m == f or m.startswith(f + ".") for f in forbidden)] == []


def imported_names(root: Path) -> list[str]:
    """``path: module`` of every import (module level or inside a function) in ``root``'s modules."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found += [f"{path.relative_to(root)}: {alias.name}" for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module is not None:
                found.append(f"{path.relative_to(root)}: {node.module}")
    return found


def test_the_engine_package_names_no_layer_above_it() -> None:
    # The import case above sees module-level imports; this sees those inside functions too.
    engine = Path(REPO_ROOT) / "kvhive" / "engine"
    assert [hit for hit in imported_names(engine)
            if any(hit.split(": ")[1] == f or hit.split(": ")[1].startswith(f + ".") for f in ENGINE_CLIENTS)] == []
