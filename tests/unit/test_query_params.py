"""Query parameters a route does not take are a 400 naming them (``kvhive.core.query_params``): on a
FastAPI app in process, routes that declare parameters, document them, or take none."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from kvhive.core.query_params import query_refusal, strict_query_route


def _app() -> FastAPI:
    app = FastAPI()
    app.router.route_class = strict_query_route(
        lambda message, param: JSONResponse(status_code=400, content={"message": message, "param": param}))

    @app.get("/plain")
    async def plain() -> dict[str, Any]:
        return {"ok": True}

    @app.get("/declared")
    async def declared(limit: int = 20, order: str = "desc") -> dict[str, Any]:
        return {"limit": limit, "order": order}

    documented = {"parameters": [{"name": "flag", "in": "query", "schema": {"type": "boolean"}},
                                 {"name": "x-header", "in": "header", "schema": {"type": "string"}}]}

    @app.post("/documented", openapi_extra=documented)
    async def reads_its_own(request: Request) -> dict[str, Any]:
        return {"flag": request.query_params.get("flag")}

    return app


def test_only_the_parameters_a_route_takes_pass() -> None:
    client = TestClient(_app())
    assert client.get("/plain").json() == {"ok": True}
    assert client.get("/declared?limit=5&order=asc").json() == {"limit": 5, "order": "asc"}
    assert client.post("/documented?flag=true").json() == {"flag": "true"}
    for url, name, takes in (("/plain?stream=true", "stream", "none"),
                             ("/declared?limit=5&after=x", "after", "'limit' and 'order'"),
                             ("/documented?flag=1&x-header=2", "x-header", "'flag'")):
        answer = client.post(url) if url.startswith("/documented") else client.get(url)
        assert answer.status_code == 400
        assert answer.json() == {"message": f"Unknown query parameter '{name}': {url.split('?')[0]} takes {takes}",
                                 "param": name}


def test_the_message_lists_what_the_route_takes_and_cuts_a_long_name() -> None:
    assert query_refusal("n" * 100, "/p", ["c", "a", "b"]) == f"Unknown query parameter '{'n' * 40}': /p takes 'a', 'b' and 'c'"
    assert query_refusal("x", "/p", []) == "Unknown query parameter 'x': /p takes none"
