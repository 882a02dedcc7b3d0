"""The engine: ``LLMEngine`` (one thread steps the scheduler and the model runner) and
``AsyncEngine`` (the asyncio front the server uses), the scheduler, the model runner and the
step types between them.

Importing this package loads nothing heavy: ``kvhive.engine.scheduler`` and ``kvhive.engine.step``
stay torch-free; the engine classes load on first use.
"""

from __future__ import annotations

from typing import Any

# name -> the module that defines it, imported on first use.
_LAZY = {"LLMEngine": "core", "RequestOutput": "core", "RequestFailed": "core",
         "AsyncEngine": "async_engine", "EngineStats": "stats", "ConnectorCounters": "stats"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"kvhive.engine.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'kvhive.engine' has no attribute {name!r}")
