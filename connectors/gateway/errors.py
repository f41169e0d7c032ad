"""The one place where HTTP failures become kvgate errors.

Transport failures: a refused or reset connection is ``Unavailable``, a request past its
deadline is ``Timeout``. Answers: the remote says what went wrong as ``{"error": kind}`` (the
kinds of ``gateway.errors``), and that kind is re-raised here as the same class; an answer
without that body falls back on its status code. A 401 is a ``ConfigError`` naming the URL,
never the token (the request headers are never formatted into a message).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import httpx

from gateway.errors import (
    CapacityError,
    ConfigError,
    CorruptObject,
    GatewayError,
    IncompleteDelete,
    InvalidKey,
    NotFound,
    Timeout,
    Unavailable,
    Unsupported,
)

KINDS: dict[str, type[GatewayError]] = {
    cls.kind: cls
    for cls in (
        InvalidKey,
        ConfigError,
        Unsupported,
        NotFound,
        CapacityError,
        CorruptObject,
        IncompleteDelete,
        Timeout,
        Unavailable,
    )
}

# By status when the answer names no kind (a proxy in between, an old server).
STATUS: dict[int, type[GatewayError]] = {
    400: InvalidKey,
    404: NotFound,
    408: Timeout,
    413: CapacityError,
    415: Unsupported,
    429: Unavailable,
    502: Unavailable,
    503: Unavailable,
    504: Timeout,
}


@contextlib.contextmanager
def transport_errors(where: str) -> Iterator[None]:
    """Map httpx's and asyncio's failures of one request to kvgate's kinds."""
    try:
        yield
    except (httpx.TimeoutException, TimeoutError):
        raise Timeout(f"{where}: no answer in time") from None
    except httpx.TransportError as exc:
        # ConnectError (refused), ReadError/WriteError (reset), RemoteProtocolError (dropped).
        raise Unavailable(f"{where}: {type(exc).__name__}: {exc}") from None


def error_for(response: httpx.Response, where: str) -> GatewayError:
    """The error an unexpected answer stands for (the body must have been read)."""
    status = response.status_code
    detail, kind = _detail(response)
    message = f"{where}: HTTP {status}" + (f": {detail}" if detail else "")
    if status == 401:
        return ConfigError(f"{where}: the gateway refused the request (401): wrong or no token")
    if status == 403:
        return ConfigError(f"{message} (forbidden)")
    if kind == "bad_request":  # the remote could not parse the request: not a key problem
        return GatewayError(message)
    cls = KINDS.get(kind or "") or STATUS.get(status)
    if cls is None:
        cls = Unavailable if status >= 500 else GatewayError
    return cls(message)


def _detail(response: httpx.Response) -> tuple[str, str | None]:
    try:
        body = json.loads(response.content[:65536]) if response.content else None
    except (ValueError, UnicodeDecodeError):
        return response.text[:200], None
    if isinstance(body, dict):
        kind = body.get("error")
        detail = body.get("detail", "")
        return str(detail)[:500], kind if isinstance(kind, str) else None
    return "", None


def remote_kind(response: httpx.Response) -> str | None:
    """The error kind the remote named in its answer, if any."""
    return _detail(response)[1]
