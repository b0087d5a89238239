"""The API key of white-box and admin routes: a bearer token, compared in constant time."""

from __future__ import annotations

import secrets
from fastapi import Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from trajbus.gateway.errors import GatewayError

BEARER = HTTPBearer(auto_error=False, description="--api-key, when the gateway has one")
"""Declares the API key in the OpenAPI schema; the guard answers 401 itself (OpenAI-shaped)."""


def api_key_guard(api_key: str | None) -> list:
    """Route dependencies that require ``api_key`` (none when it is unset)."""

    def require_api_key(credentials: HTTPAuthorizationCredentials | None = Depends(BEARER)) -> None:
        if api_key is None:
            return
        token = credentials.credentials if credentials is not None else ""
        if not secrets.compare_digest(token.encode(), api_key.encode()):
            raise GatewayError(401, "missing or wrong API key (Authorization: Bearer <key>)",
                               type_="authentication_error", code="invalid_api_key")

    return [Depends(require_api_key)]
