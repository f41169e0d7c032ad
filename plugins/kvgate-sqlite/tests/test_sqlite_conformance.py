"""kvgate's connector conformance suite on the sqlite plugin, as installed (its wheel)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

try:
    from kvgate_sqlite import SqliteConnector
except ModuleNotFoundError:  # the plugin is installed by .ci/plugins; CI must not skip it
    if os.environ.get("CI"):
        raise
    pytest.skip("kvgate-sqlite is not installed (bash .ci/plugins)", allow_module_level=True)

from gateway.connector import Connector
from gateway.testing import ConnectorConformance, ConnectorFactory


class TestSqliteConformance(ConnectorConformance):
    @pytest.fixture
    def connector_factory(self, tmp_path: Path) -> ConnectorFactory:
        url = f"sqlite://{tmp_path / 'tier.db'}"

        async def make() -> Connector:
            return SqliteConnector.from_url(url)

        return make
