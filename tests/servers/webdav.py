"""A real WebDAV server for the opendal+webdav tests: WsgiDAV (PyPI, the test extra) on
loopback, serving a temp folder to anonymous clients.

``webdav_server`` is shared by the session (each test uses its own key prefix);
``webdav_private`` is a server of its own for a test that kills or stalls it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from servers.proc import ServerProcess, free_port, port_open, require_binary

HINT = "pip install 'kvgate[test]' (wsgidav, cheroot)"


@dataclass
class WebdavServer:
    process: ServerProcess
    port: int
    folder: Path

    url = "opendal+webdav:///kvgate"

    def options(self, **extra: Any) -> dict[str, Any]:
        return {"endpoint": f"http://127.0.0.1:{self.port}", **extra}


def start_webdav(directory: Path) -> WebdavServer:
    binary = require_binary("wsgidav", HINT)
    folder = directory / "dav"
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = [binary, "--host", "127.0.0.1", "--port", str(port), "--root", str(folder)]
    argv += ["--auth", "anonymous", "--no-config", "-q"]
    process = ServerProcess(
        argv, ready=lambda: port_open(port), log_path=directory / f"wsgidav-{port}.log"
    )
    return WebdavServer(process.start(), port, folder)


@pytest.fixture(scope="session")
def webdav_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebdavServer]:
    server = start_webdav(tmp_path_factory.mktemp("webdav"))
    try:
        yield server
    finally:
        server.process.stop()


@pytest.fixture
def webdav_private(tmp_path: Path) -> Iterator[WebdavServer]:
    server = start_webdav(tmp_path)
    try:
        yield server
    finally:
        server.process.stop()
