"""A real kvgate HTTP service on loopback, in its own process, for the gateway:// tests.

The service runs ``gateway.http.app.create_app`` under uvicorn in a subprocess (its own
interpreter: the client's event loop and the server's do not share a GIL), with a Store whose
only tier is an in-process memory tier. ``token`` sets the bearer token the service requires.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from servers.proc import ServerProcess, free_port, port_open

# Run inside the server process. The token goes through the environment, never argv.
_LAUNCH = """
import json, os, sys
import uvicorn
from gateway.http.app import create_app
cfg = json.loads(sys.argv[1])
token = os.environ.get("TEST_GATEWAY_TOKEN") or None
tls = json.loads(sys.argv[3])
app = create_app(cfg, token=token)
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning", **tls)
"""


@dataclass
class GatewayServer:
    port: int
    process: ServerProcess
    token: str | None = None

    @property
    def url(self) -> str:
        return f"gateway://127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def start_gateway(
    log_dir: Path,
    *,
    capacity: str = "1GiB",
    max_object_size: str = "512MiB",
    token: str | None = None,
    certfile: Path | None = None,
    keyfile: Path | None = None,
    lower_tiers: tuple[dict[str, Any], ...] = (),
) -> GatewayServer:
    """``certfile``/``keyfile``: serve HTTPS (for ``gateways://``). ``lower_tiers``: tier
    configs after the memory tier."""
    port = free_port()
    cfg = {
        "tiers": [{"url": "memory://", "capacity": capacity}, *lower_tiers],
        "prefault": False,
        "max_object_size": max_object_size,
    }
    tls = {"ssl_certfile": str(certfile), "ssl_keyfile": str(keyfile)} if certfile else {}
    env = {"TEST_GATEWAY_TOKEN": token} if token else {}
    proc = ServerProcess(
        [sys.executable, "-c", _LAUNCH, json.dumps(cfg), str(port), json.dumps(tls)],
        ready=lambda: port_open(port),
        log_path=log_dir / f"kvgate-{port}.log",
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    proc.start()
    return GatewayServer(port, proc, token)


def gateway_server_at(log_dir: Path, **kwargs: Any) -> Iterator[GatewayServer]:
    server = start_gateway(log_dir, **kwargs)
    try:
        yield server
    finally:
        server.process.stop()
