"""An ASGI app under uvicorn on the test's own event loop, on a free loopback port."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI

from servers.proc import free_port


async def serve(app: FastAPI, **options: Any) -> AsyncIterator[str]:
    """Run ``app`` under uvicorn on a free loopback port; yields its base URL. ``options`` go
    to ``uvicorn.Config`` (``http=`` a protocol class, say)."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            app, host="127.0.0.1", port=port, log_level="warning", lifespan="on", **options
        )
    )
    task = asyncio.create_task(server.serve())
    for _ in range(500):  # uvicorn has no "started" event to await: poll, bounded (5 s)
        if server.started or task.done():
            break
        await asyncio.sleep(0.01)
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


@contextlib.asynccontextmanager
async def running(app: FastAPI, **options: Any) -> AsyncIterator[str]:
    """``serve`` as a ``with`` block: closed even when the test fails inside (an async
    generator left open keeps the server, and the test session, running)."""
    server = serve(app, **options)
    try:
        yield await anext(server)
    finally:
        await server.aclose()
