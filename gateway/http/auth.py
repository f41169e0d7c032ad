"""Bearer-token authentication for the HTTP API.

The token comes from ``kvgate serve --token``, ``$KVGATE_TOKEN`` or the caller of
``create_app``; it is compared in constant time (``hmac.compare_digest``) and never logged or
echoed. Without a configured token every request is let through, which ``kvgate serve`` allows
only on a loopback address. Health endpoints and the OpenAPI document stay open.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from gateway.bearer import token_problem
from gateway.errors import GatewayError

bearer = HTTPBearer(auto_error=False, description="the token kvgate serve was started with")


class Unauthorized(GatewayError):
    """No bearer token, or not the configured one."""

    kind = "unauthorized"


def _bytes(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def token_guard(token: str) -> Callable[..., Awaitable[None]]:
    """A FastAPI dependency that refuses a request without ``Authorization: Bearer <token>``."""
    if not token:
        raise ValueError("an empty token would let everyone in")
    problem = token_problem(token)
    if problem is not None:
        raise ValueError(problem)
    expected = _bytes(token)

    async def require_token(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
    ) -> None:
        if credentials is None:
            raise Unauthorized("this gateway needs an Authorization: Bearer <token> header")
        if not hmac.compare_digest(_bytes(credentials.credentials), expected):
            raise Unauthorized("wrong bearer token")

    return require_token
