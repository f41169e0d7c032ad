"""The HTTP face of a Store (FastAPI). The lifespan owns one Store.

This is the minimal service that ``kvgate serve`` runs: the object API, health and tier state.
Objects travel as their raw bytes; a tensor's dtype and shape travel in headers. Errors map to
status codes in exactly one place (``STATUS``).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from gateway.errors import (
    CapacityError,
    ConfigError,
    CorruptObject,
    GatewayError,
    InvalidKey,
    NotFound,
    Timeout,
    Unavailable,
    Unsupported,
)
from gateway.objects import HAS_TORCH, ITEMSIZE, to_object_data
from gateway.store import ConfigSource, Store
from gateway.tiers import offload

DEFAULT_MAX_BODY = 1 << 30
H_KIND, H_DTYPE, H_SHAPE = "x-kvgate-kind", "x-kvgate-dtype", "x-kvgate-shape"

# The one error -> HTTP status map. Order matters: subclasses before their parents.
STATUS: list[tuple[type[GatewayError], int]] = [
    (InvalidKey, 400),
    (ConfigError, 400),
    (Unsupported, 415),
    (NotFound, 404),
    (CapacityError, 413),
    (CorruptObject, 502),
    (Timeout, 504),
    (Unavailable, 503),
    (GatewayError, 500),
]


def status_of(exc: GatewayError) -> int:
    return next(code for cls, code in STATUS if isinstance(exc, cls))


async def _read_body(request: Request, limit: int) -> bytearray:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise CapacityError(f"request body of {declared} bytes exceeds the limit of {limit}")
    body = bytearray(int(declared)) if declared and declared.isdigit() else bytearray()
    body.clear()
    async for chunk in request.stream():
        if len(body) + len(chunk) > limit:
            raise CapacityError(f"request body exceeds the limit of {limit} bytes")
        body += chunk
    return body


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(d) for d in text.split(",") if d.strip() != "")
    except ValueError:
        raise InvalidKey(f"bad {H_SHAPE} header {text!r}: comma-separated integers") from None
    if any(d < 0 for d in shape):
        raise InvalidKey(f"bad {H_SHAPE} header {text!r}: negative dimension")
    return shape


def _as_object(body: bytearray, dtype: str | None, shape_text: str | None) -> object:
    if dtype is None:
        return bytes(body)
    if dtype not in ITEMSIZE:
        raise Unsupported(f"unknown dtype {dtype!r}")
    shape = _parse_shape(shape_text) if shape_text is not None else (len(body) // ITEMSIZE[dtype],)
    if math.prod(shape) * ITEMSIZE[dtype] != len(body):
        raise InvalidKey(f"shape {shape} of {dtype} does not match {len(body)} body bytes")
    if HAS_TORCH:
        import torch

        flat = (
            torch.frombuffer(body, dtype=torch.uint8) if body else torch.empty(0, dtype=torch.uint8)
        )
        return flat.view(getattr(torch, dtype)).reshape(shape)
    return np.frombuffer(body, dtype=np.dtype(dtype)).reshape(shape)


def create_app(config: ConfigSource = None, *, max_body: int = DEFAULT_MAX_BODY) -> FastAPI:
    store = Store(config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with store:
            yield

    app = FastAPI(title="kvgate", version="0.1.0", lifespan=lifespan)
    app.state.store = store

    @app.exception_handler(GatewayError)
    async def gateway_error(_: Request, exc: GatewayError) -> JSONResponse:
        return JSONResponse({"error": exc.kind, "detail": str(exc)}, status_code=status_of(exc))

    @app.put("/v1/objects/{key:path}", status_code=204)
    async def put_object(key: str, request: Request) -> Response:
        body = await _read_body(request, max_body)
        obj = _as_object(body, request.headers.get(H_DTYPE), request.headers.get(H_SHAPE))
        await store.put(key, obj)
        return Response(status_code=204)

    @app.get("/v1/objects/{key:path}")
    async def get_object(key: str) -> Response:
        obj = await store.get(key)
        if obj is None:
            return JSONResponse({"error": "not_found", "detail": key}, status_code=404)
        data = to_object_data(obj)
        headers = {
            H_KIND: data.meta.kind,
            H_DTYPE: data.meta.dtype,
            H_SHAPE: ",".join(str(d) for d in data.meta.shape),
        }
        body = await offload(data.meta.nbytes, lambda: bytes(data.host()))
        return Response(body, media_type="application/octet-stream", headers=headers)

    @app.head("/v1/objects/{key:path}")
    async def head_object(key: str) -> Response:
        return Response(status_code=200 if await store.contains(key) else 404)

    @app.delete("/v1/objects/{key:path}")
    async def delete_object(key: str) -> Response:
        return Response(status_code=204 if await store.delete(key) else 404)

    @app.post("/v1/flush", status_code=204)
    async def flush() -> Response:
        await store.flush()
        return Response(status_code=204)

    @app.get("/v1/tiers")
    async def tiers() -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, stats in store.stats().items():
            out[name] = {
                "hits": stats.hits,
                "misses": stats.misses,
                "bytes_read": stats.bytes_read,
                "bytes_written": stats.bytes_written,
                "errors": stats.errors,
                "corrupt": stats.corrupt,
                "skipped_writes": stats.skipped_writes,
                "queue_depth": stats.queue_depth,
                "evictions": stats.evictions,
            }
        return out

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return app
