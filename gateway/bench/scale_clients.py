"""``kvgate bench scale``'s second curve: ``kvgate serve`` against concurrent HTTP clients.

The server is started as a user starts it (``kvgate serve --config ...`` in its own process,
on uvloop and httptools when installed), with a memory tier over a disk tier in a scratch
directory, the default config's shape. The clients run in a third process
(``scale_load``). For each object size and client count: throughput and p50/p99 of puts and of
gets, and the server's CPU per operation and resident memory.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gateway.bench.scale_stats import loadavg, loglog_slope

START_TIMEOUT = 60.0  # seconds for the server to answer: imports and the pool's prefault


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for_port(port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"kvgate serve exited ({proc.returncode}): {log.read_text()[-2000:]}"
            )
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"kvgate serve did not listen on {port} in {START_TIMEOUT:.0f} s")


def server_config(scratch: Path, memory: str) -> dict[str, Any]:
    return {
        "tiers": [
            {"url": "memory://", "capacity": memory},
            {"url": f"file://{scratch / 'disk'}", "capacity": "8GiB"},
        ]
    }


def run_clients_curve(
    sizes: Sequence[int],
    clients: Sequence[int],
    *,
    duration: float,
    memory: str = "1GiB",
    on_point: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Start ``kvgate serve``, drive it with each client count per size, stop it."""
    points: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvgate-scale-serve-") as tmp:
        scratch = Path(tmp)
        config = scratch / "kvgate.yaml"
        config.write_text(json.dumps(server_config(scratch, memory)))  # JSON is YAML
        port = _free_port()
        log = scratch / "serve.log"
        argv = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)]
        argv += ["--port", str(port), "--log-level", "warning"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
        with log.open("wb") as out:
            server = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            _wait_for_port(port, server, log)
            spec = {"sizes": list(sizes), "clients": list(clients), "duration": duration}
            load = [sys.executable, "-m", "gateway.bench.scale_load"]
            load += [f"http://127.0.0.1:{port}", str(server.pid), json.dumps(spec)]
            with subprocess.Popen(load, stdout=subprocess.PIPE, text=True) as clients_proc:
                assert clients_proc.stdout is not None
                for line in clients_proc.stdout:
                    point = json.loads(line)
                    point["loadavg"] = loadavg()
                    points.append(point)
                    if on_point is not None:
                        on_point(point)
            if clients_proc.returncode != 0:
                raise RuntimeError(f"the clients exited with {clients_proc.returncode}")
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    return points


def clients_slopes(points: Sequence[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per size and phase, the growth exponents of throughput and p99 against clients.

    Throughput with slope 1 scales perfectly; 0 is saturated. Once saturated, p99 must grow
    with slope 1 (Little's law: each client waits behind the others); above 1 means the server
    does more work per request as clients are added."""
    out: dict[str, dict[str, float | None]] = {}
    for size in sorted({p["size"] for p in points}):
        rows = [p for p in points if p["size"] == size]
        xs = [float(p["clients"]) for p in rows]
        for phase in ("put", "get"):
            out[f"{phase} {size}"] = {
                "ops_per_s": loglog_slope(xs, [p[phase]["ops_per_s"] for p in rows]),
                "p99_ms": loglog_slope(xs, [p[phase]["p99_ms"] for p in rows]),
                "server_cpu_us_per_op": loglog_slope(
                    xs, [p[phase]["server_cpu_us_per_op"] for p in rows]
                ),
            }
    return out
