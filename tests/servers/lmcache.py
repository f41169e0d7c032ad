"""LMCache 0.5.6 on loopback: the stock ``lmcache_server`` and LMCache's own lm:// client.

LMCache lives in its own virtual environment (``.ci/lmcache-env`` makes it: it pins numpy and
pulls dependencies kvgate does not need), named by ``INTEROP_LMCACHE_VENV`` or
``.venv-lmcache`` in the repository root. Missing, its tests skip on a developer machine and
FAIL in CI. LMCache's client runs as ``benchmarks/lm_bench.py`` under that venv's python.

``lmcache_server``: a session-wide stock server, as the URL ``lm://127.0.0.1:P``.
``run_lmcache_client(args)``: runs lm_bench.py with ``args`` under LMCache's python.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from servers.proc import ServerProcess, free_port, in_ci, port_open

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "lm_bench.py"
_HINT = "run .ci/lmcache-env"
ENV = {"LMCACHE_DISABLE_BANNER": "1", "PYTHONHASHSEED": "0"}


def lmcache_venv() -> Path:
    """The venv holding LMCache; skips locally, fails in CI, when it is not there."""
    venv = Path(os.environ.get("INTEROP_LMCACHE_VENV") or ROOT / ".venv-lmcache")
    if (venv / "bin" / "lmcache_server").exists():
        return venv
    message = f"LMCache 0.5.6 is not installed in {venv} ({_HINT})"
    if in_ci():
        pytest.fail(message)
    pytest.skip(message)


async def run_lmcache_client(args: Sequence[str], limit_s: float = 120.0) -> dict[str, Any]:
    """``benchmarks/lm_bench.py args`` under LMCache's python: its JSON answer.

    Async, so that a kvgate server on the test's own event loop keeps serving meanwhile.
    """
    python = lmcache_venv() / "bin" / "python"
    proc = await asyncio.create_subprocess_exec(
        str(python),
        str(BENCH),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **ENV},
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), limit_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    if proc.returncode != 0:
        raise AssertionError(f"LMCache client failed:\n{err.decode(errors='replace')[-4000:]}")
    return dict(json.loads(out.decode().strip().splitlines()[-1]))


def start_lmcache_server(log_dir: Path) -> tuple[ServerProcess, int]:
    binary = lmcache_venv() / "bin" / "lmcache_server"
    port = free_port()
    process = ServerProcess(
        [str(binary), "127.0.0.1", str(port), "cpu"],
        ready=lambda: port_open(port),
        log_path=log_dir / f"lmcache-{port}.log",
        env=ENV,
        ready_timeout=60.0,  # importing torch and LMCache takes a few seconds
    )
    return process.start(), port


@pytest.fixture(scope="session")
def lmcache_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL of a session-wide stock ``lmcache_server 127.0.0.1 P cpu``."""
    process, port = start_lmcache_server(tmp_path_factory.mktemp("lmcache"))
    try:
        yield f"lm://127.0.0.1:{port}"
    finally:
        process.stop()
