"""The engine: ``LLMEngine`` (one thread steps the scheduler and the model runner) and
``AsyncEngine`` (the asyncio front the server uses), the scheduler, the model runner and the
step types between them.

Importing this package loads nothing heavy: ``kvhive.engine.scheduler`` and ``kvhive.engine.step``
stay torch-free; the engine classes load on first use.
"""

from __future__ import annotations

from typing import Any

_LAZY = {"LLMEngine", "AsyncEngine", "EngineStats", "RequestOutput", "RequestFailed"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from kvhive.engine import core

        return getattr(core, name)
    raise AttributeError(f"module 'kvhive.engine' has no attribute {name!r}")
