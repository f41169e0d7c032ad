"""The conformance suite on opendal+<service>:// against real servers: memory, fs, WebDAV
(WsgiDAV), FTP (pyftpdlib), Azure Blob (azurite) and GCS (gcp-storage-emulator); the last two
on the same emulators as the native azure:// and gs:// (tests/conformance/test_azure.py,
test_gcs.py). OpenDAL 0.47's wheel has no sftp service, so SFTP is not run."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from servers.azurite import AzuriteServer
from servers.ftp import FtpServer
from servers.gcs_emulator import GcsServer
from servers.webdav import WebdavServer

from connectors.opendal import OpendalConnector
from gateway.connector import Connector
from gateway.testing import ConnectorConformance, ConnectorFactory


class TestOpendalMemoryConformance(ConnectorConformance):
    @pytest.fixture
    def connector_factory(self) -> ConnectorFactory:
        async def make() -> Connector:
            return OpendalConnector.from_url("opendal+memory://")

        return make


class TestOpendalFsConformance(ConnectorConformance):
    @pytest.fixture
    def connector_factory(self, tmp_path: Path) -> ConnectorFactory:
        async def make() -> Connector:
            return OpendalConnector.from_url(f"opendal+fs://{tmp_path}")

        return make


class TestOpendalWebdavConformance(ConnectorConformance):
    """WsgiDAV's MOVE deletes the target before moving the new file in, so with the default
    ``atomic=rename`` a reader can miss an overwritten key for a moment; ``sealed`` never
    misses (tests/test_opendal.py runs rename mode on WebDAV too)."""

    @pytest.fixture
    def connector_factory(self, webdav_server: WebdavServer) -> ConnectorFactory:
        async def make() -> Connector:
            return OpendalConnector.from_url(
                webdav_server.url, **webdav_server.options(atomic="sealed")
            )

        return make


class TestOpendalFtpConformance(ConnectorConformance):
    @pytest.fixture
    def connector_factory(self, ftp_server: FtpServer) -> ConnectorFactory:
        async def make() -> Connector:
            return OpendalConnector.from_url(ftp_server.url, **ftp_server.options())

        return make


class TestOpendalAzblobConformance(ConnectorConformance):
    """Azure Blob cannot rename; a Put Blob replaces a blob whole: ``atomic=native``, the
    default for object stores."""

    @pytest.fixture
    def connector_factory(self, azurite_server: AzuriteServer) -> ConnectorFactory:
        url = f"opendal+azblob:///conformance-{uuid.uuid4().hex[:8]}"
        options = azurite_server.opendal_options()

        async def make() -> Connector:
            return OpendalConnector.from_url(url, **options)

        return make


class TestOpendalGcsConformance(ConnectorConformance):
    """GCS cannot rename; an upload replaces an object whole: ``atomic=native``, the
    default for object stores."""

    @pytest.fixture
    def connector_factory(self, gcs_server: GcsServer) -> ConnectorFactory:
        url = f"opendal+gcs:///conformance-{uuid.uuid4().hex[:8]}"
        options = gcs_server.opendal_options()

        async def make() -> Connector:
            return OpendalConnector.from_url(url, **options)

        return make
