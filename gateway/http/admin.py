"""Operator endpoints: flush, tier state, liveness, readiness and Prometheus metrics.

``/healthz`` answers while the process serves HTTP; ``/readyz`` only once the store is open
and its first tier answers (the in-process memory tier always does; a connector tier is
pinged, bounded by its timeout). Both stay open when a token is configured: orchestrators
probe them without credentials, and they reveal nothing about the objects.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request, Response

from gateway.errors import GatewayError, Unavailable
from gateway.http.metrics import CONTENT_TYPE, exposition
from gateway.http.state import state_of
from gateway.http.tier_state import tier_states


def admin_router() -> APIRouter:
    """The endpoints behind authentication."""
    router = APIRouter(tags=["admin"])

    @router.post("/v1/flush", status_code=204, response_class=Response)
    async def flush(request: Request) -> Response:
        """Wait until every accepted write has reached (or failed at) its tier."""
        await state_of(request).store.flush()
        return Response(status_code=204)

    @router.get("/v1/tiers")
    async def tiers(request: Request) -> dict[str, list[dict[str, Any]]]:
        """Each tier, fastest first: state, breaker, capacity, usage, queue depth, counters."""
        return {"tiers": [t.as_dict() for t in tier_states(state_of(request).store)]}

    @router.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {CONTENT_TYPE: {"schema": {"type": "string"}}}}},
    )
    async def metrics(request: Request) -> Response:
        """Per-tier counters, gauges and latency histograms (Prometheus text format)."""
        return Response(exposition(request.app.state.metrics), media_type=CONTENT_TYPE)

    return router


def health_router() -> APIRouter:
    """The endpoints open to everyone."""
    router = APIRouter(tags=["health"])

    @router.get("/healthz")
    async def healthz() -> dict[str, str]:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @router.get("/readyz", responses={503: {"description": "Not ready"}})
    async def readyz(request: Request) -> dict[str, str]:
        """Readiness: the store is open and its first tier answers."""
        state = state_of(request)
        store = state.store
        if not state.ready:
            raise Unavailable("the store is not open")
        if store.l1 is None and store.tiers:
            first = store.tiers[0]
            try:
                async with asyncio.timeout(store.config.tiers[0].timeout):
                    await first.connector.ping()
            except (GatewayError, OSError, TimeoutError) as exc:
                raise Unavailable(f"tier {first.name} does not answer: {exc}") from None
        return {"status": "ready"}

    return router
