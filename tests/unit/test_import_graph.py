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
# The packages of the server extra (pyproject.toml): the gateway is installed without it.
SERVER_EXTRA = ("gguf", "safetensors", "llguidance")

CASES = {
    # The scheduler side: block pool, KV manager, stores, sessions, requests, config.
    "scheduler-side": (
        ["kvhive.engine.scheduler", "kvhive.kv.pool", "kvhive.kv.manager", "kvhive.core.blocks",
         "kvhive.store.tiered", "kvhive.store.disk", "kvhive.store.memory", "kvhive.store.redis",
         "kvhive.core.tokenizer", "kvhive.engine.step", "kvhive.request", "kvhive.config",
         "kvhive.sessions.registry", "kvhive.sessions.response_store", "kvhive.store.redis_guard"],
        ("torch", "kvhive.engine.runner", "kvhive.model")),
    # The KV-event wire format and the routing library import only the torch-free core below them:
    # neither the KV package, nor the gateway process, nor an integration.
    "events-and-routing": (
        ["kvhive.core.kv_events", "kvhive.routing", "kvhive.routing.ingest", "kvhive.routing.index",
         "kvhive.routing.scorer", "kvhive.routing.prompts", "kvhive.routing.indexer",
         "kvhive.routing.block_keys", "kvhive.routing.affinity", "kvhive.routing.dialects",
         "kvhive.routing.redis_link", "kvhive.core.replica_registry"],
        (*ABOVE_THE_ROUTER, "kvhive.kv", "kvhive.gateway", "kvhive.integrations")),
    # The gateway process: torch-free, without the KV package (the wire format is core's) and without
    # the server extra's packages.
    "gateway": (
        ["kvhive.gateway", "kvhive.gateway.app", "kvhive.gateway.cli", "kvhive.gateway.gateway",
         "kvhive.gateway.discovery", "kvhive.gateway.wiring", "kvhive.core.tenancy", "kvhive.core.http_protocol"],
        (*ABOVE_THE_ROUTER, *SERVER_EXTRA, "kvhive.kv", "kvhive.integrations")),
    # What ``kvhive gateway`` imports, from the console script's module on (it parses ``kvhive serve``'s
    # flags too, so the engine's config and its KV-event settings are loaded; neither needs ``kv``).
    "gateway-command": (
        ["kvhive.cli", "kvhive.gateway.app", "kvhive.gateway.cli"],
        (*ABOVE_THE_ROUTER, *SERVER_EXTRA, "kvhive.kv", "kvhive.integrations")),
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
    # The Ray application's router and ingress run in the ingress process: torch-free, no engine; they
    # use the routing library, never the gateway process.
    "ray-router": (
        ["kvhive.integrations.ray", "kvhive.integrations.ray.router", "kvhive.integrations.ray.ingress",
         "kvhive.integrations.ray.replica_routing", "kvhive.integrations.ray.envelope"],
        (*ABOVE_THE_ROUTER, "kvhive.gateway")),
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


# Packages whose every import, lazy ones inside functions included, stays out of the gateway process.
GATEWAY_FREE = ("kvhive/routing", "kvhive/integrations/ray")


def imported_names(tree: ast.AST) -> list[str]:
    """Every module an ``import`` or ``from ... import`` anywhere in ``tree`` names (absolute only)."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def static_imports_of(package: str, forbidden: tuple[str, ...]) -> list[str]:
    """``path: module`` of each import in ``package``'s modules (module level or inside a function)
    that names one of ``forbidden`` or a module under it."""
    return [f"{path.relative_to(Path(REPO_ROOT))}: {name}"
            for path in sorted((Path(REPO_ROOT) / package).rglob("*.py"))
            for name in imported_names(ast.parse(path.read_text()))
            if any(name == f or name.startswith(f + ".") for f in forbidden)]


def test_the_engine_package_names_no_layer_above_it() -> None:
    # The import cases above see module-level imports; this sees those inside functions too.
    assert static_imports_of("kvhive/engine", ENGINE_CLIENTS) == []


@pytest.mark.parametrize("package", GATEWAY_FREE)
def test_imports_nothing_from_the_gateway_process(package: str) -> None:
    assert static_imports_of(package, ("kvhive.gateway",)) == []
