"""Query parameters a route does not take are refused, never ignored (torch-free; the server and
the gateway share it).

FastAPI drops a query parameter no route reads: ``POST /v1/chat/completions?stream=true`` would
answer unstreamed without a word. ``strict_query_route`` makes a route class whose routes answer
400 naming the first parameter they do not take: those their handler declares (FastAPI's query
parameters) and those their OpenAPI entry documents (``openapi_extra["parameters"]``, for routes
that read the query themselves, such as ``/reset_prefix_cache``). The answer is the caller's
(``refuse``), so each app keeps its error shape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

# The longest parameter name an error repeats.
SHOWN_CHARS = 40

Refuse = Callable[[str, str], Response]


def query_refusal(name: str, path: str, taken: Iterable[str]) -> str:
    """The message for query parameter ``name`` on ``path``, which takes ``taken``."""
    names = [f"'{n}'" for n in sorted(taken)]
    takes = "none" if not names else names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
    return f"Unknown query parameter {name[:SHOWN_CHARS]!r}: {path} takes {takes}"


def documented_query(openapi_extra: dict[str, Any] | None) -> frozenset[str]:
    """The query parameters an OpenAPI entry's extra ``parameters`` document."""
    parameters = (openapi_extra or {}).get("parameters", ())
    return frozenset(p["name"] for p in parameters if isinstance(p, dict) and p.get("in") == "query")


def strict_query_route(refuse: Refuse) -> type[APIRoute]:
    """A route class whose routes answer ``refuse(message, parameter)`` to a query parameter they
    do not take, before the handler runs."""

    class StrictQueryRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Any]:
            handler = super().get_route_handler()
            taken = frozenset(p.alias for p in self.dependant.query_params) | documented_query(self.openapi_extra)
            path = self.path

            async def checked(request: Request) -> Response:
                for name in request.query_params:
                    if name not in taken:
                        return refuse(query_refusal(name, path, taken), name[:SHOWN_CHARS])
                return await handler(request)

            return checked

    return StrictQueryRoute
