"""Errors as OpenAI's API returns them, so every client library reports them well.

Body: ``{"error": {"message", "type", "param", "code"}}``. Request validation
failures become 400 naming the offending field; nothing is published for a
request that fails here. Every error the gateway answers has this body, an
unexpected exception too (500, logged with its traceback): no client sees a
framework's plain-text page.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("trajbus.gateway")


class GatewayError(Exception):
    """An error with an HTTP status and an OpenAI-style body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after = retry_after
        """Seconds after which a retry may succeed (the ``Retry-After`` header); None: do not retry."""

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return JSONResponse(self.body(), self.status, headers=headers)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, code=code)


def not_found(message: str) -> GatewayError:
    return GatewayError(404, message, code="not_found")


def conflict(message: str) -> GatewayError:
    return GatewayError(409, message, code="conflict")


RETRY_SECONDS = 2
"""What a 503 tells the client to wait: the broker, a backend or the gateway itself is not ready yet."""


def unavailable(message: str, code: str = "not_ready", retry_after: int = RETRY_SECONDS) -> GatewayError:
    return GatewayError(503, message, type_="service_unavailable", code=code, retry_after=retry_after)


def from_value_error(exc: ValueError) -> GatewayError:
    """Record validation says ``field: problem``; the field becomes ``param``."""
    text = str(exc)
    field = text.split(":", 1)[0] if ":" in text and " " not in text.split(":", 1)[0] else None
    return bad_request(text, param=field)


def _location(loc: tuple) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    return ".".join(parts) or "body"


def from_validation_error(exc: RequestValidationError | ValidationError) -> GatewayError:
    """400 naming the first field that failed validation (FastAPI's or a model checked in a route)."""
    first = exc.errors()[0]
    if first.get("type") == "json_invalid":
        return bad_request(f"body: invalid JSON ({first.get('ctx', {}).get('error', 'parse error')})", param="body")
    where = _location(tuple(first.get("loc", ())))
    return bad_request(f"{where}: {first.get('msg', 'invalid value')}", param=where)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        if exc.status >= 500:
            log.warning("request failed path=%s status=%d error=%s", request.url.path, exc.status, exc.message)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
        error = GatewayError(exc.status_code, str(exc.detail), code=code)
        return error.response()

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        """A backstop: a bug still answers OpenAI-shaped JSON (Starlette logs the traceback)."""
        log.error("unexpected error path=%s error=%r", request.url.path, exc)
        return GatewayError(500, "internal error of the gateway (logged)", type_="server_error",
                            code="internal_error").response()
