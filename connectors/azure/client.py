"""The connector's one azure-storage-blob (aio) client: built on first use, closed by close().

Built from the credential ``config.credential`` finds. The SDK's own retries are off (the tier
has a retry layer, and a retry inside a call would outlast its timeout); its socket timeouts
and transfer sizes come from the options.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from azure.core.exceptions import ResourceExistsError
from azure.storage.blob.aio import BlobServiceClient, ContainerClient

from connectors.azure.config import (
    AzureOptions,
    Credential,
    Location,
    account_url,
    connection_string_account,
    credential,
)
from connectors.azure.errors import azure_errors
from gateway.errors import ConfigError


def client_options(opts: AzureOptions) -> dict[str, Any]:
    options: dict[str, Any] = {
        "connection_timeout": opts.connect_timeout,
        "read_timeout": opts.read_timeout,
        "retry_total": 0,
        "max_single_put_size": opts.put_threshold,
        "max_block_size": opts.block_size,
        "max_single_get_size": opts.ranged_get_threshold,
        "max_chunk_get_size": opts.range_size,
    }
    if opts.api_version is not None:
        options["api_version"] = opts.api_version
    return options


def new_service(location: Location, opts: AzureOptions, cred: Credential) -> BlobServiceClient:
    kwargs = client_options(opts)
    secret = cred.secret.get_secret_value()
    if cred.kind == "connection_string":
        if opts.endpoint is not None:
            raise ConfigError("give the endpoint in the connection string, not as an option")
        named = connection_string_account(secret)
        if named is not None and named != location.account:
            raise ConfigError(
                f"the connection string ({cred.where}) is for account {named!r}, the URL names "
                f"{location.account!r}"
            )
        try:
            return BlobServiceClient.from_connection_string(secret, **kwargs)
        except ValueError:
            raise ConfigError(f"{cred.where} is not a valid connection string") from None
    url = account_url(location, opts)
    if cred.kind == "account_key":
        key = {"account_name": location.account, "account_key": secret}
        return BlobServiceClient(url, credential=key, **kwargs)
    return BlobServiceClient(url, credential=secret.lstrip("?"), **kwargs)


class AzureClient:
    """Where the connector's calls go: its container, on one service client."""

    def __init__(self, location: Location, opts: AzureOptions, where: str) -> None:
        self.location = location
        self.options = opts
        self.where = where
        self._credential = credential(opts)  # at construction: a missing one fails at start
        self.secret = self._credential.secret.get_secret_value()
        self._service: BlobServiceClient | None = None
        self._container: ContainerClient | None = None
        self._lock = asyncio.Lock()

    async def container(self) -> ContainerClient:
        if self._container is not None:
            return self._container
        async with self._lock:
            if self._container is None:
                service = new_service(self.location, self.options, self._credential)
                container = service.get_container_client(self.location.container)
                if self.options.create_container:
                    await self._create(container)
                self._service, self._container = service, container
        return self._container

    async def _create(self, container: ContainerClient) -> None:
        where = f"{self.where} CREATE CONTAINER"
        with azure_errors(where, self.location.container, self.secret):
            async with asyncio.timeout(self.options.request_timeout):
                with contextlib.suppress(ResourceExistsError):
                    await container.create_container()

    async def close(self) -> None:
        service, self._service, self._container = self._service, None, None
        if service is not None:
            await service.close()
