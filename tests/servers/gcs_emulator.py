"""A real GCS JSON API for the tests: gcp-storage-emulator (PyPI, the ``test`` extra) on loopback.

What it does and does not do, checked against its source (2026.7.19), and so what the gs://
tests can and cannot show:
- media, multipart and resumable uploads, compose, ranged GETs (206 with Content-Range),
  listing with prefix and pages, delete, bucket metadata: supported, tested for real;
- no credentials (an emulator never checks them): the wrong-credential path is not tested;
- no ``x-goog-generation`` header and no ``generation=`` on downloads: the ranged reads' pin
  to one generation is not exercised here;
- one request at a time (``http.server.HTTPServer``, HTTP/1.0, a new connection per request):
  parallel parts and ranges are correct but not faster, and its speed says nothing about
  GCS's;
- where it answers unlike GCS (a listen backlog of 5 that resets a few dozen parallel
  connections; an upload without a Content-Type or with an empty body, as OpenDAL's gcs
  service sends them), the fixture starts it through ``gcs_emulator_launch.py``, which fixes
  those three and nothing else.

``gcs_server`` is shared by the session (each test uses its own prefix); ``gcs_server_private``
is one of its own for a test that kills or stalls it. Data lives in memory.
"""

from __future__ import annotations

import contextlib
import json
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from servers.proc import ServerProcess, free_port, port_open, require_binary

BUCKET = "kvgate-test"


@dataclass
class GcsServer:
    process: ServerProcess
    port: int
    bucket: str = BUCKET

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, prefix: str = "") -> str:
        return f"gs://{self.bucket}/{prefix}"

    def options(self, **extra: Any) -> dict[str, Any]:
        return {"endpoint": self.endpoint, **extra}

    def opendal_options(self, **extra: Any) -> dict[str, Any]:
        """``opendal+gcs:///<root>`` options for this server: anonymous (the emulator checks
        no credentials), and no looking for any in the environment or a VM's metadata."""
        return {
            "endpoint": self.endpoint,
            "bucket": self.bucket,
            "allow_anonymous": True,
            "disable_vm_metadata": True,
            "disable_config_load": True,
            **extra,
        }

    def start(self) -> None:
        self.process.start()
        _wait_for_bucket(self)

    def kill(self) -> None:
        self.process.kill()

    def stop(self) -> None:
        self.process.stop(timeout=2.0)


def _wait_for_bucket(server: GcsServer) -> None:
    url = f"{server.endpoint}/storage/v1/b/{server.bucket}"
    with urllib.request.urlopen(url, timeout=5) as resp:  # the default bucket is there
        assert json.load(resp)["name"] == server.bucket


_LAUNCH = Path(__file__).with_name("gcs_emulator_launch.py")
"""The emulator's own entry point with what it answers unlike GCS fixed (see that file)."""


def make_server(root: Path) -> GcsServer:
    require_binary("gcp-storage-emulator", "pip install gcp-storage-emulator")
    port = free_port()
    argv = [
        sys.executable,
        "-P",  # tests/servers/ not on sys.path: its modules would shadow packages
        str(_LAUNCH),
        "start",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--in-memory",
        "--default-bucket",
        BUCKET,
        "--quiet",
    ]
    process = ServerProcess(
        argv, ready=lambda: port_open(port), log_path=root / "gcs.out", cwd=root
    )
    return GcsServer(process, port)


@contextlib.contextmanager
def running(root: Path) -> Iterator[GcsServer]:
    root.mkdir(parents=True, exist_ok=True)
    server = make_server(root)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GcsServer]:
    with running(tmp_path_factory.mktemp("gcs")) as server:
        yield server


@pytest.fixture
def gcs_server_private(tmp_path: Path) -> Iterator[GcsServer]:
    with running(tmp_path / "gcs") as server:
        yield server
