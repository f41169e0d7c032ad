"""A real FTP server for the opendal+ftp tests: pyftpdlib (PyPI, the test extra) on loopback,
one user with write access to a temp folder."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from servers.proc import ServerProcess, free_port, in_ci, port_open

USER, PASSWORD = "kvgate", "kvgate-ftp-pa55"


@dataclass
class FtpServer:
    process: ServerProcess
    port: int
    folder: Path

    url = "opendal+ftp:///kvgate"

    def options(self, **extra: Any) -> dict[str, Any]:
        return {
            "endpoint": f"ftp://127.0.0.1:{self.port}",
            "user": USER,
            "password": PASSWORD,
            **extra,
        }


def start_ftp(directory: Path) -> FtpServer:
    if importlib.util.find_spec("pyftpdlib") is None:
        message = "pyftpdlib is not installed (pip install 'kvgate[test]')"
        if in_ci():
            pytest.fail(message)
        pytest.skip(message)
    folder = directory / "ftp"
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = [sys.executable, "-m", "pyftpdlib", "-i", "127.0.0.1", "-p", str(port)]
    argv += ["-d", str(folder), "-w", "-u", USER, "-P", PASSWORD]
    process = ServerProcess(
        argv, ready=lambda: port_open(port), log_path=directory / f"ftp-{port}.log"
    )
    return FtpServer(process.start(), port, folder)


@pytest.fixture(scope="session")
def ftp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FtpServer]:
    server = start_ftp(tmp_path_factory.mktemp("ftp"))
    try:
        yield server
    finally:
        server.process.stop()
