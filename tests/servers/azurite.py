"""A real Azure Blob service for the tests: azurite (Microsoft's emulator) on loopback.

``.ci/azurite`` installs it from npm into ``.servers/azurite``; a ``azurite-blob`` on PATH is
used too. Each server has an account of its own with a random key (``AZURITE_ACCOUNTS``), so
the tests use real shared-key auth and a wrong key is refused. Data lives in memory.

``azurite_server`` is shared by the session (each test uses its own prefix);
``azurite_server_private`` is one of its own for a test that kills or stalls it.
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from servers.proc import ServerProcess, free_port, in_ci, port_open

CONTAINER = "kvgate-test"
_REPO = Path(__file__).resolve().parents[2]


def azurite_binary() -> str:
    """The azurite-blob launcher; skip locally, fail in CI, when it is not installed."""
    local = _REPO / ".servers" / "azurite" / "node_modules" / ".bin" / "azurite-blob"
    found = str(local) if local.exists() else shutil.which("azurite-blob")
    if found and shutil.which("node"):
        return found
    message = "azurite is not installed (bash .ci/azurite)"
    if in_ci():
        pytest.fail(message)
    pytest.skip(message)


@dataclass
class AzuriteServer:
    process: ServerProcess
    port: int
    account: str
    key: str
    container: str = CONTAINER

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/{self.account}"

    @property
    def connection_string(self) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={self.account};AccountKey={self.key};"
            f"BlobEndpoint={self.endpoint};"
        )

    def url(self, prefix: str = "") -> str:
        return f"azure://{self.account}/{self.container}/{prefix}"

    def options(self, **extra: Any) -> dict[str, Any]:
        """Connector options for this server (``extra`` overrides)."""
        return {"endpoint": self.endpoint, "account_key": self.key, **extra}

    def opendal_options(self, **extra: Any) -> dict[str, Any]:
        """``opendal+azblob:///<root>`` options for this server (``extra`` overrides)."""
        return {
            "endpoint": self.endpoint,
            "account_name": self.account,
            "account_key": self.key,
            "container": self.container,
            **extra,
        }

    def start(self) -> None:
        self.process.start()
        _create_container(self)

    def kill(self) -> None:
        self.process.kill()

    def stop(self) -> None:
        # azurite waits for idle keep-alive connections on SIGTERM; its data is in memory
        self.process.stop(timeout=1.0)


def _create_container(server: AzuriteServer) -> None:
    from azure.core.exceptions import ResourceExistsError
    from azure.storage.blob import BlobServiceClient

    service = BlobServiceClient.from_connection_string(server.connection_string)
    with service, contextlib.suppress(ResourceExistsError):
        service.create_container(server.container)


def make_server(root: Path) -> AzuriteServer:
    binary = azurite_binary()
    port = free_port()
    account = f"kvgate{uuid.uuid4().hex[:8]}"
    key = base64.b64encode(os.urandom(64)).decode()
    argv = [
        binary,
        "--inMemoryPersistence",
        "--blobHost",
        "127.0.0.1",
        "--blobPort",
        str(port),
        "--skipApiVersionCheck",
        "--disableProductStyleUrl",
        "--silent",
    ]
    env = {"AZURITE_ACCOUNTS": f"{account}:{key}"}
    process = ServerProcess(
        argv, ready=lambda: port_open(port), log_path=root / "azurite.out", env=env, cwd=root
    )
    return AzuriteServer(process, port, account, key)


@contextlib.contextmanager
def running(root: Path) -> Iterator[AzuriteServer]:
    root.mkdir(parents=True, exist_ok=True)
    server = make_server(root)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def azurite_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AzuriteServer]:
    with running(tmp_path_factory.mktemp("azurite")) as server:
        yield server


@pytest.fixture
def azurite_server_private(tmp_path: Path) -> Iterator[AzuriteServer]:
    with running(tmp_path / "azurite") as server:
        yield server
