"""The HTTP face of a Store (FastAPI): the app factory, its lifespan and the one error map.

The lifespan owns one Store (opened before the first request, drained and closed at
shutdown), the pool that request bodies are read into, and the *companions* a caller asks
for: services that run beside the app on the same Store, such as LMCache's lm:// server, which
``kvgate serve`` starts this way (this wing does not import that one). Routes live in
``objects`` (the object API), ``batch``, ``keys`` and ``admin``; every error any of them raises
becomes a status code here, in ``STATUS``, and a JSON body ``{"error": kind, "detail": ...}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from gateway.errors import (
    CapacityError,
    ConfigError,
    CorruptObject,
    GatewayError,
    IncompleteDelete,
    InvalidKey,
    InvalidObject,
    NotFound,
    Timeout,
    Unavailable,
    Unsupported,
)
from gateway.http.admin import admin_router, health_router
from gateway.http.auth import Unauthorized, token_guard
from gateway.http.batch import batch_router
from gateway.http.body import BadRequest
from gateway.http.byte_budget import ByteBudget
from gateway.http.keys import keys_router
from gateway.http.log import redact_access_log
from gateway.http.metrics import metrics_registry
from gateway.http.objects import object_router
from gateway.http.pace import DEFAULT_BODY_MIN_RATE, DEFAULT_BODY_TIMEOUT, BodyPace, BodyTimeout
from gateway.http.state import DEFAULT_BODY_POOL, DEFAULT_MAX_BODY, ServiceState
from gateway.memory import BufferPool
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
    (IncompleteDelete, 502),  # a tier behind this service failed; the service itself is up
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

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, _: ClientDisconnect) -> Response:
        # The client left mid-body: not the server's fault, and no one reads the answer (its
        # status is never sent). What was read of the body is already given back (``read_body``
        # releases it as it fails), and handled here the error is not re-raised for uvicorn to
        # log as a crash.
        log.debug(
            "client left before its request body arrived: %s %s", request.method, request.url.path
        )
        return Response(status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error serving a request")
        return error_response("internal", type(exc).__name__, 500)


Companion = Callable[[Store], AbstractAsyncContextManager[object]]
"""A service that runs beside the app on its Store (``create_app``'s ``companions``)."""

# Errors that refuse the service's start for a reason its operator can fix (a tier's directory
# in use by another server or read-only, a missing dependency, a port taken): recorded on the
# state, so that ``kvgate serve`` can say so in one line. A bug's exception keeps its traceback.
STARTUP_REFUSALS = (GatewayError, OSError)


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
    companions: Sequence[Companion] = (),
) -> FastAPI:
    """The kvgate HTTP app over a Store built from ``config``.

    ``token``: require ``Authorization: Bearer <token>`` on everything but the health
    endpoints and the OpenAPI document. ``max_body``: the largest request body (413 past it).
    ``body_pool``: bytes kept prefaulted for request bodies. ``body_budget``: bytes all
    request bodies may hold at once (default twice ``max_body``); past it a request waits up to
    ``budget_wait`` seconds, then gets 503. ``body_timeout``: seconds a request body may stall
    before the request fails with 408; ``body_min_rate``: bytes per second a body must average
    after its first ``body_timeout`` seconds (0: any rate). ``companions``: each is called
    with the opened Store and entered for the app's lifetime (started in order after the Store
    opens, stopped in reverse before it closes).
    """
    state = ServiceState(Store(config), max_body=max_body, body_pool_size=body_pool)
    state.body_budget = ByteBudget(body_budget or 2 * max_body, budget_wait)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            try:
                await stack.enter_async_context(state.store)  # closed last
                if state.body_pool_size:  # prefaulting touches every page: not on the loop
                    state.body_pool = await asyncio.to_thread(
                        BufferPool, state.body_pool_size, pin=False, prefault=True
                    )
                for companion in companions:  # stopped before the store closes
                    await stack.enter_async_context(companion(state.store))
            except STARTUP_REFUSALS as exc:  # a directory in use, a port taken, ...
                state.startup_error = exc
                raise
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
