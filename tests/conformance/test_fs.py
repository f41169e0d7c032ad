"""file:// against the conformance suite, on a fresh directory per test."""

from __future__ import annotations

from pathlib import Path

import pytest

from connectors.fs import FileConnector
from gateway.connector import Connector
from gateway.testing import ConnectorConformance, ConnectorFactory


class TestFileConformance(ConnectorConformance):
    @pytest.fixture
    def connector_factory(self, tmp_path: Path) -> ConnectorFactory:
        url = (tmp_path / "store").as_uri()

        async def make() -> Connector:
            return FileConnector.from_url(url)

        return make
