"""file:// against the conformance suite, on a fresh directory per test: as configured by
default, and with ``direct_io`` (O_DIRECT reads; the suite's payloads are not page-aligned,
so its puts take the buffered path, which tests/test_fs_direct.py complements)."""

from __future__ import annotations

from pathlib import Path

import pytest

from connectors.fs.connector import FileConnector
from gateway.connector import Connector
from gateway.testing import ConnectorConformance, ConnectorFactory

# Transports differ between asyncio's loop and uvloop (what `kvgate serve` runs on).
pytestmark = pytest.mark.both_loops


class TestFileConformance(ConnectorConformance):
    @pytest.fixture
    def connector_factory(self, tmp_path: Path) -> ConnectorFactory:
        url = (tmp_path / "store").as_uri()

        async def make() -> Connector:
            return FileConnector.from_url(url)

        return make


class TestFileDirectIoConformance(ConnectorConformance):
    @pytest.fixture
    def connector_factory(self, tmp_path: Path) -> ConnectorFactory:
        url = (tmp_path / "store").as_uri()

        async def make() -> Connector:
            return FileConnector.from_url(url, direct_io=True)

        return make
