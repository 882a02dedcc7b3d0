"""Anthropic's error shape, torch-free: ``{"type": "error", "error": {"type": ..., "message": ...}}``
with its own type per status (``invalid_request_error`` 400, ``authentication_error`` 401,
``permission_error`` 403, ``not_found_error`` 404, ``request_too_large`` 413,
``rate_limit_error`` 429, ``api_error`` 500 and 502, ``overloaded_error`` 503 and 529,
``timeout_error`` 504; another 4xx is an invalid request, another 5xx an api error). The gateway
answers its own errors on /v1/messages in it and re-shapes a replica's error body into it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

# Anthropic's error type for each status it documents.
ERROR_TYPES: Mapping[int, str] = MappingProxyType({
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
    502: "api_error", 503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"})


def anthropic_error_type(status: int) -> str:
    """Anthropic's error type for an answer of ``status``."""
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """An error body in Anthropic's shape."""
    return {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}


def as_anthropic_error(status: int, raw: bytes) -> dict[str, Any]:
    """A replica's error body in Anthropic's shape: kept when it already is, else its message
    (OpenAI's ``error.message``, a flat ``message`` or ``detail``, plain text) re-wrapped."""
    try:
        data = json.loads(raw) if raw else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        data = None
    if isinstance(data, dict) and data.get("type") == "error" and isinstance(data.get("error"), dict):
        return data
    inner = data.get("error") if isinstance(data, dict) else None
    found = inner.get("message") if isinstance(inner, dict) else (
        data.get("message", data.get("detail")) if isinstance(data, dict) else None)
    if found is None and data is None:
        found = raw.decode("utf-8", "replace").strip() if raw else ""
    message = found if isinstance(found, str) else json.dumps(found)
    return anthropic_error_body(status, message or f"replica answered HTTP {status}")

