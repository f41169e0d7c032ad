"""The HTTP face of a Store (FastAPI): the app factory, its lifespan and the one error map.

The lifespan owns one Store (opened before the first request, drained and closed at
shutdown), the pool that request bodies are read into, and, with ``lm_port``, LMCache's lm://
server on the same Store. Routes live in ``http_objects`` (the object API), ``http_batch`` and
``http_admin``; every error any of them raises becomes a status code here, in ``STATUS``, and a
JSON body ``{"error": kind, "detail": message}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from gateway.auth import Unauthorized, token_guard
from gateway.byte_budget import ByteBudget
from gateway.errors import (
    CapacityError,
    ConfigError,
    CorruptObject,
    GatewayError,
    InvalidKey,
    InvalidObject,
    NotFound,
    Timeout,
    Unavailable,
    Unsupported,
)
from gateway.http_admin import admin_router, health_router
from gateway.http_batch import batch_router
from gateway.http_body import BadRequest
from gateway.http_keys import keys_router
from gateway.http_log import redact_access_log
from gateway.http_objects import object_router
from gateway.http_pace import DEFAULT_BODY_MIN_RATE, DEFAULT_BODY_TIMEOUT, BodyPace, BodyTimeout
from gateway.http_state import DEFAULT_BODY_POOL, DEFAULT_MAX_BODY, ServiceState
from gateway.memory import BufferPool
from gateway.prometheus import metrics_registry
from gateway.store import ConfigSource, Store

log = logging.getLogger("kvgate.service")

# The one error -> HTTP status map. Order matters: subclasses before their parents.
# A corrupt object is the backend's fault (502) when the store reads one; a corrupt frame sent
# by a client is a BadRequest (400) raised where the request is read.
STATUS: list[tuple[type[GatewayError], int]] = [
    (BadRequest, 400),
    (InvalidKey, 400),
    (InvalidObject, 400),
    (ConfigError, 400),
    (Unauthorized, 401),
    (NotFound, 404),
    (BodyTimeout, 408),
    (CapacityError, 413),
    (Unsupported, 415),
    (CorruptObject, 502),
    (Timeout, 504),
    (Unavailable, 503),
    (GatewayError, 500),
]


def status_of(exc: GatewayError) -> int:
    return next(code for cls, code in STATUS if isinstance(exc, cls))


def error_response(kind: str, detail: str, status: int) -> JSONResponse:
    headers = {"www-authenticate": "Bearer"} if status == 401 else None
    if status == 408:  # the rest of the body may still come: it must not read as a request
        headers = {"connection": "close"}
    return JSONResponse({"error": kind, "detail": detail}, status_code=status, headers=headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(GatewayError)
    async def gateway_error(_: Request, exc: GatewayError) -> JSONResponse:
        return error_response(exc.kind, str(exc), status_of(exc))

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        # A path or header parameter FastAPI could not read: the client's error, like ours.
        problems = "; ".join(
            f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg', '')}" for e in exc.errors()
        )
        return error_response(BadRequest.kind, problems or "invalid request", 400)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        # Starlette's own: unknown route (404), wrong method (405).
        kind = NotFound.kind if exc.status_code == 404 else "http"
        return error_response(kind, str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error serving a request")
        return error_response("internal", type(exc).__name__, 500)


def create_app(
    config: ConfigSource = None,
    *,
    token: str | None = None,
    max_body: int = DEFAULT_MAX_BODY,
    body_pool: int = DEFAULT_BODY_POOL,
    body_budget: int | None = None,
    budget_wait: float = 30.0,
    body_timeout: float = DEFAULT_BODY_TIMEOUT,
    body_min_rate: int = DEFAULT_BODY_MIN_RATE,
    lm_host: str = "127.0.0.1",
    lm_port: int | None = None,
    lm_idle_timeout: float | None = None,
) -> FastAPI:
    """The kvgate HTTP app over a Store built from ``config``.

    ``token``: require ``Authorization: Bearer <token>`` on everything but the health
    endpoints and the OpenAPI document. ``max_body``: the largest request body (413 past it).
    ``body_pool``: bytes kept prefaulted for request bodies. ``body_budget``: bytes all
    request bodies may hold at once (default twice ``max_body``); past it a request waits up to
    ``budget_wait`` seconds, then gets 503. ``body_timeout``: seconds a request body may stall
    before the request fails with 408; ``body_min_rate``: bytes per second a body must average
    after its first ``body_timeout`` seconds (0: any rate). ``lm_port``: also serve LMCache's
    lm:// protocol there (on ``lm_host``), on the same Store; it has no authentication, so the
    caller decides whether ``lm_host`` may be public (``kvgate serve`` refuses that unless told).
    ``lm_idle_timeout``: close lm:// connections idle that long (None: keep them).
    """
    state = ServiceState(Store(config), max_body=max_body, body_pool_size=body_pool)
    state.body_budget = ByteBudget(body_budget or 2 * max_body, budget_wait)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with state.store, contextlib.AsyncExitStack() as stack:
            if state.body_pool_size:  # prefaulting touches every page: not on the loop
                state.body_pool = await asyncio.to_thread(
                    BufferPool, state.body_pool_size, pin=False, prefault=True
                )
            if lm_port is not None:
                from gateway.lmserver import close_lm, serve_lm  # only when asked for

                server = await serve_lm(state.store, lm_host, lm_port, idle_timeout=lm_idle_timeout)
                stack.push_async_callback(close_lm, server)  # before the store closes
            state.ready = True
            try:
                yield
            finally:
                state.ready = False

    app = FastAPI(
        title="kvgate",
        version="0.1.0",
        summary="Tiered KV-cache object store gateway",
        lifespan=lifespan,
    )
    app.state.kvgate = state
    app.state.metrics = metrics_registry(state.store)
    _add_error_handlers(app)
    app.add_middleware(BodyPace, idle=body_timeout, min_rate=body_min_rate)
    redact_access_log()  # a token a client put in a query string never reaches the log
    guarded = [Depends(token_guard(token))] if token is not None else []
    app.include_router(health_router())
    for router in (object_router(), keys_router(), batch_router(), admin_router()):
        app.include_router(router, dependencies=guarded)
    return app
