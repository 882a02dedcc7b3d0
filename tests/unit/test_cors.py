"""Opt-in CORS (``kvhive.core.cors``): the flags' two list forms, the settings' checks, and the
gateway's answers to a browser's preflight and actual requests (in process, no replica needed)."""

from __future__ import annotations

import argparse
import asyncio

import httpx
import pytest

from kvhive.core.cors import MAX_CORS_ENTRIES, CorsConfig, cors_from_args, cors_list

ORIGIN = "https://app.example"


def test_lists_as_json_or_comma_separated() -> None:
    assert cors_list('["*"]') == ("*",)
    assert cors_list('["https://a.example", "https://b.example"]') == ("https://a.example", "https://b.example")
    assert cors_list("https://a.example, https://b.example") == ("https://a.example", "https://b.example")
    assert cors_list("GET,POST") == ("GET", "POST")
    for bad in ("[", '["a", 1]', "", " , ", ",".join(["x"] * (MAX_CORS_ENTRIES + 1))):
        with pytest.raises(argparse.ArgumentTypeError):
            cors_list(bad)


def _args(**given: object) -> argparse.Namespace:
    values = {"allowed_origins": None, "allowed_methods": None, "allowed_headers": None, "allow_credentials": False}
    return argparse.Namespace(**{**values, **given})


def test_settings_are_off_unless_origins_are_given() -> None:
    assert cors_from_args(_args()) is None
    config = cors_from_args(_args(allowed_origins=(ORIGIN,)))
    assert config == CorsConfig((ORIGIN,), ("*",), ("*",), False)
    with pytest.raises(ValueError, match="--allowed-methods needs --allowed-origins"):
        cors_from_args(_args(allowed_methods=("GET",)))
    with pytest.raises(ValueError, match="--allow-credentials needs --allowed-origins"):
        cors_from_args(_args(allow_credentials=True))
    with pytest.raises(ValueError, match="not '\\*'"):
        cors_from_args(_args(allowed_origins=("*",), allow_credentials=True))


@pytest.mark.parametrize("cors", [None, CorsConfig((ORIGIN,), ("POST",))])
def test_the_gateway_answers_browsers_only_when_asked(tokenizer, cors: CorsConfig | None) -> None:
    from kvhive.gateway.app import create_gateway_app
    from kvhive.gateway.gateway_config import GatewayConfig, ReplicaSpec

    app = create_gateway_app(GatewayConfig((ReplicaSpec("http://127.0.0.1:9"),)), tokenizer, cors=cors)

    async def scenario() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
            preflight = await client.options("/v1/chat/completions", headers={
                "Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
            stranger = await client.options("/v1/chat/completions", headers={
                "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
            actual = await client.get("/metrics", headers={"Origin": ORIGIN})
            return preflight, stranger, actual

    preflight, stranger, actual = asyncio.run(scenario())
    assert "access-control-allow-origin" not in stranger.headers
    if cors is None:
        assert "access-control-allow-origin" not in preflight.headers
        assert "access-control-allow-origin" not in actual.headers
        return
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ORIGIN
    assert preflight.headers["access-control-allow-methods"] == "POST"
    assert actual.status_code == 200 and actual.headers["access-control-allow-origin"] == ORIGIN
