"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvhive.core.json_body import BodyError, validation_body_error
from kvhive.engine.request_errors import ConstraintRefused
from kvhive.sessions.registry import (
    SessionBusy,
    SessionError,
    SessionInvalid,
    SessionLimit,
    SessionNotDurable,
    SessionNotFound,
    SessionStale,
)

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error the server answers in OpenAI's shape; raise it anywhere inside a route."""

    def __init__(self, status_code: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI clients parse."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        """This error as an HTTP response."""
        return JSONResponse(status_code=self.status_code, content=self.body())


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 invalid_request_error."""
    return APIError(400, message, param=param, code=code)


def constraint_error(exc: ConstraintRefused) -> APIError:
    """A 400 for a request whose structured-output constraint (``response_format``, ``guided_*``,
    a tool's schema) ended its output (``kvhive.engine.request_errors``: no token of this model can
    continue it, or it reached the grammar engine's limits)."""
    return bad_request(f"{exc.summary}: {exc.detail}", code=exc.code)


def body_error(exc: BodyError) -> APIError:
    """A 400 for a body ``kvhive.core.json_body.load_json`` refused."""
    return bad_request(exc.message, param=exc.param)


# The one place session refusals get their HTTP status (each kind is a subclass of SessionError).
SESSION_ERROR_STATUS: dict[type[SessionError], int] = {
    SessionInvalid: 400,
    SessionNotFound: 404,
    SessionBusy: 409,
    SessionStale: 409,
    SessionLimit: 429,
    SessionNotDurable: 507,        # Insufficient Storage: its record could not be written to disk
}


def session_error(exc: SessionError) -> APIError:
    """A session (or stored response) refusal as an OpenAI-shaped error with its kind's status."""
    status = next(code for kind, code in SESSION_ERROR_STATUS.items() if isinstance(exc, kind))
    error_type = ("rate_limit_error" if status == 429 else "server_error" if status >= 500
                  else "invalid_request_error")
    return APIError(status, exc.message, type=error_type, param=exc.param, code=exc.code)


def server_error(message: str) -> APIError:
    """A 500 server error (the engine failed, not the request)."""
    return APIError(500, message, type="server_error", code="internal_server_error")


def validation_error(errors: Sequence[Any]) -> APIError:
    """A 400 from pydantic / FastAPI validation errors, naming the first offending field."""
    return body_error(validation_body_error(errors))


def install_error_handlers(app: FastAPI) -> None:
    """Make every error the app can produce (ours, validation, routing, crashes) OpenAI-shaped."""

    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return exc.response()

    async def on_session_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, SessionError)
        return session_error(exc).response()

    async def on_validation_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError | ValidationError)
        return validation_error(exc.errors()).response()

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            message = f"Unknown route: {request.method} {request.url.path}"
            return APIError(404, message, code="not_found").response()
        if exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}"
            return APIError(405, message, code="method_not_allowed").response()
        error_type = "server_error" if exc.status_code >= 500 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=error_type).response()

    async def on_crash(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return server_error(f"Internal server error: {type(exc).__name__}: {exc}").response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(SessionError, on_session_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(ValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_crash)
