"""The ``azure://`` connector: ``AzureConnector`` (see the package docstring for the design)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, ClassVar, Self

from azure.core.exceptions import HttpResponseError

from connectors import object_names as names
from connectors.azure.client import AzureClient, new_service
from connectors.azure.config import credential, parse
from connectors.azure.errors import azure_errors, is_missing
from connectors.azure.transfer import download, upload
from connectors.object_store import OBJECT_STORE_CAPABILITIES, ObjectStoreConnector
from gateway.client_baseline import baseline_objects, timed_put_get
from gateway.connector import Allocator
from gateway.types import ObjectInfo

KEY_META = "kvgate_key"
"""Where a hashed name's key is kept: Azure's metadata names must be C# identifiers."""


class AzureConnector(ObjectStoreConnector):
    scheme: ClassVar[str] = "azure"
    capabilities = OBJECT_STORE_CAPABILITIES
    key_meta = KEY_META

    def __init__(self, url: str, **options: Any) -> None:
        self.location, self.options = parse(url, options)
        self.batch_concurrency = self.options.batch_concurrency
        self._track_objects(self.location.prefix)
        self._client = AzureClient(self.location, self.options, repr(self))

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Self:
        return cls(url, **options)

    def __repr__(self) -> str:
        loc = self.location
        endpoint = f" at {self.options.endpoint}" if self.options.endpoint else ""
        return f"AzureConnector(azure://{loc.account}/{loc.container}/{loc.prefix}{endpoint})"

    def _errors(self, what: str) -> contextlib.AbstractContextManager[None]:
        where = f"{self!r} {what}"
        return azure_errors(where, self.location.container, self._client.secret)

    # -- the object-store hooks --------------------------------------------------------------

    async def _download(self, name: str, alloc: Allocator) -> memoryview | None:
        return await download(self._client, name, alloc)

    async def _stat(self, name: str) -> Any:
        return await self._properties(name)

    async def _upload(self, name: str, parts: list[memoryview], meta: dict[str, str]) -> None:
        await upload(self._client, name, parts, meta)

    async def _close_client(self) -> None:
        await self._client.close()

    async def _properties(self, name: str) -> Any:
        with self._errors(f"HEAD {names.shown(name)}"):
            container = await self._client.container()
            try:
                async with asyncio.timeout(self.options.request_timeout):
                    return await container.get_blob_client(name).get_blob_properties()
            except HttpResponseError as exc:
                if is_missing(exc):
                    return None
                raise

    # -- writes ------------------------------------------------------------------------------

    async def delete(self, key: str) -> bool:
        """Delete ``key``; whether it existed (Delete Blob answers 404 when it did not)."""
        with self._op():
            name = self._name(key)
            if name is None:
                return False
            with self._errors(f"DELETE {names.shown(name)}"):
                container = await self._client.container()
                try:
                    async with asyncio.timeout(self.options.request_timeout):
                        await container.delete_blob(name)
                except HttpResponseError as exc:
                    if is_missing(exc):
                        return False
                    raise
            return True

    # -- listing (last: ``list`` would shadow the builtin in annotations below it) -----------

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        """Every stored key starting with ``prefix``, with its size, a page of blobs at a time.

        The listing carries each blob's metadata, so a hashed (very long) key costs no extra
        request.
        """
        with self._op(), self._errors(f"LIST {prefix!r}"):
            container = await self._client.container()
            pages = container.list_blobs(
                name_starts_with=self._names.list_prefix(prefix), include=["metadata"]
            ).by_page()
        while True:
            with self._op():  # not held across a yield: a consumer may pause or stop anywhere
                with self._errors(f"LIST {prefix!r}"):
                    try:
                        async with asyncio.timeout(self.options.request_timeout):
                            page = await anext(pages)
                            blobs = [blob async for blob in page]
                    except StopAsyncIteration:
                        return
                found = []
                for blob in blobs:
                    key = self._key_of(str(blob.name), blob.metadata or {})
                    if key is not None and key.startswith(prefix):
                        found.append(ObjectInfo(key, int(blob.size)))
            for info in found:
                yield info

    def _key_of(self, name: str, metadata: dict[str, str]) -> str | None:
        if not self._names.is_hashed(name):
            return self._names.key_of(name)
        key = names.key_from_metadata(metadata, KEY_META)
        # Only a blob of ours: its name is the one its key maps to.
        return key if key is not None and self._name(key) == name else None

    # -- the benchmark's reference -----------------------------------------------------------

    @classmethod
    async def raw_client_baseline(
        cls,
        url: str,
        options: Mapping[str, Any],
        *,
        size: int,
        count: int,
        concurrency: int,
        payloads: Sequence[bytes] = (),
    ) -> tuple[float, float]:
        """(put GB/s, get GB/s) of plain azure-storage-blob (aio): one ``upload_blob`` and one
        ``download_blob().readall()`` per object, on a client configured like the connector's
        (its transfer sizes and concurrency included)."""
        location, opts = parse(url, options)
        service = new_service(location, opts, credential(opts))
        objects = baseline_objects(size, payloads)
        base = f"{location.prefix}kvgate-baseline/{uuid.uuid4().hex[:12]}-"
        async with service:
            container = service.get_container_client(location.container)

            async def put(i: int) -> object:
                return await container.upload_blob(
                    f"{base}{i}",
                    objects[i % len(objects)],
                    overwrite=True,
                    max_concurrency=opts.max_concurrency,
                )

            async def get(i: int) -> int:
                got = await container.download_blob(
                    f"{base}{i}", max_concurrency=opts.max_concurrency
                )
                return len(await got.readall())

            try:
                with azure_errors("azure baseline", location.container):
                    return await timed_put_get(
                        put, get, size=size, count=count, concurrency=concurrency
                    )
            finally:
                for i in range(count):
                    with contextlib.suppress(Exception):
                        await container.delete_blob(f"{base}{i}")
