"""``POST /reset_prefix_cache``: vLLM's route and query parameters, with an answer that says what it did.

- No parameter: the device pool forgets every cached block that no running request and no session
  holds (held blocks stay; vLLM refuses while blocks are in use, kvhive drops the rest).
- ``reset_external=true``: the store tiers this replica owns (CPU memory, local disk) also drop every
  block no live session pins; the shared Redis tier keeps its blocks (other replicas read it).
- ``reset_running_requests``: only ``false`` is taken; kvhive never stops running requests to
  reset, so ``true`` is a 400.

The reset runs on the engine's loop thread between steps (``EngineClient.reset_prefix_cache``). The
answer is 200 with the blocks dropped and still held per level ("device", then the tiers by name);
the KV-event stream carries ``AllBlocksCleared`` and then every block still held.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request

from kvhive.server.errors import bad_request, server_error
from kvhive.server.generation import GenerationService

logger = logging.getLogger(__name__)

PATH = "/reset_prefix_cache"
_BOOLEANS = {"true": True, "false": False, "1": True, "0": False}
_SHOWN_CHARS = 40          # of a bad value, echoed in the error


def _flag(name: str, raw: str) -> bool:
    """A query boolean: true/false (any case) or 1/0; 400 naming the parameter otherwise."""
    value = _BOOLEANS.get(raw.lower())
    if value is None:
        raise bad_request(f"Invalid value for '{name}': expected true or false, got "
                          f"{raw[:_SHOWN_CHARS]!r}", param=name)
    return value


def reset_external_flag(query: list[tuple[str, str]]) -> bool:
    """``reset_external`` from the query (whose names the route class has checked against the two
    ``_OPENAPI`` documents), each given once, a boolean; 400 otherwise (``reset_running_requests=true``
    included: running requests keep their blocks)."""
    flags: dict[str, bool] = {}
    for name, raw in query:
        if name in flags:
            raise bad_request(f"Query parameter '{name}' is given more than once", param=name)
        flags[name] = _flag(name, raw)
    if flags.get("reset_running_requests"):
        raise bad_request("reset_running_requests=true is not supported: the blocks of running "
                          "requests and sessions are kept, everything else is dropped",
                          param="reset_running_requests")
    return flags.get("reset_external", False)


_OPENAPI: dict[str, Any] = {"parameters": [
    {"name": "reset_external", "in": "query", "required": False, "schema": {"type": "boolean", "default": False},
     "description": "also drop the unpinned blocks of this replica's CPU and disk tiers (never Redis)"},
    {"name": "reset_running_requests", "in": "query", "required": False,
     "schema": {"type": "boolean", "default": False},
     "description": "vLLM's parameter; only false: running requests and sessions keep their blocks"},
]}


def install_prefix_cache_routes(app: FastAPI, service: GenerationService) -> None:
    """Add ``POST /reset_prefix_cache``."""
    engine = service.engine

    @app.post(PATH, openapi_extra=_OPENAPI)
    async def reset_prefix_cache(raw_request: Request) -> dict[str, dict[str, int]]:
        """Drop the cached KV blocks nobody holds; the blocks dropped and still held, per level."""
        reset_external = reset_external_flag(raw_request.query_params.multi_items())
        try:
            done = await engine.reset_prefix_cache(reset_external)
        except RuntimeError as exc:           # the engine loop has stopped
            raise server_error(str(exc)) from exc
        logger.info("prefix cache reset: dropped %s, kept %s", done.dropped, done.kept)
        return {"dropped_blocks": done.dropped, "kept_blocks": done.kept}
