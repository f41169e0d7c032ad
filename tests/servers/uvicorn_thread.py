"""An ASGI app served by a real uvicorn on a loopback port, in a thread of the test process
(for tests that drive it with blocking clients: hypothesis, schemathesis)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

from servers.proc import free_port

START_S = 10.0


def serve_in_thread(app: Any, **options: Any) -> Iterator[str]:
    """Serve ``app`` until the generator is closed; yields its base URL. ``options`` go to
    ``uvicorn.Config``."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, **options)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + START_S
    while not server.started:
        assert thread.is_alive(), "uvicorn exited"
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=START_S)
