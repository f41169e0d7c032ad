"""The ``azure://`` connector: ``AzureConnector`` (see the package docstring for the design)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any, ClassVar, Self

from azure.core.exceptions import HttpResponseError

from connectors import object_names as names
from connectors.azure.client import AzureClient, new_service
from connectors.azure.config import credential, parse
from connectors.azure.errors import azure_errors, is_missing
from connectors.azure.transfer import download, upload
from gateway.client_baseline import timed_put_get
from gateway.connector import Allocator, BaseConnector, as_parts
from gateway.errors import GatewayError, InvalidKey
from gateway.inflight import InFlight
from gateway.types import Buffer, BufferParts, Capabilities, ObjectInfo

KEY_META = "kvgate_key"
"""Where a hashed name's key is kept: Azure's metadata names must be C# identifiers."""


def _no_buffer(size: int) -> memoryview | None:
    return None  # the read then fills a buffer of its own


class AzureConnector(BaseConnector):
    scheme: ClassVar[str] = "azure"
    capabilities = Capabilities(
        list=True, zero_copy=True, persistent=True, max_key_length=names.MAX_KEY_BYTES
    )

    def __init__(self, url: str, **options: Any) -> None:
        self.location, self.options = parse(url, options)
        self.batch_concurrency = self.options.batch_concurrency
        self._names = names.Naming(self.location.prefix)
        self._client = AzureClient(self.location, self.options, repr(self))
        self._in_flight = InFlight()
        self._closed = False

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Self:
        return cls(url, **options)

    def __repr__(self) -> str:
        loc = self.location
        endpoint = f" at {self.options.endpoint}" if self.options.endpoint else ""
        return f"AzureConnector(azure://{loc.account}/{loc.container}/{loc.prefix}{endpoint})"

    @contextlib.contextmanager
    def _op(self) -> Iterator[None]:
        if self._closed:
            raise GatewayError(f"{self!r} is closed")
        with self._in_flight.track():
            yield

    def _errors(self, what: str) -> contextlib.AbstractContextManager[None]:
        where = f"{self!r} {what}"
        return azure_errors(where, self.location.container, self._client.secret)

    def _name(self, key: str) -> str | None:
        """The blob name of ``key``; None if the key is too long to be stored."""
        if not key:
            raise InvalidKey("a key must not be empty")
        if len(key.encode()) > names.MAX_KEY_BYTES:
            return None
        return self._names.object_name(key)

    # -- reads -------------------------------------------------------------------------------

    async def get(self, key: str) -> Buffer | None:
        got = await self.get_into(key, _no_buffer)
        return got.obj if got is not None and isinstance(got.obj, bytearray) else got

    async def get_into(self, key: str, alloc: Allocator) -> memoryview | None:
        with self._op():
            name = self._name(key)
            if name is None:
                return None
            return await download(self._client, name, alloc)

    async def exists(self, key: str) -> bool:
        with self._op():
            name = self._name(key)
            return name is not None and await self._properties(name) is not None

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

    async def put(self, key: str, data: BufferParts) -> None:
        with self._op():
            name = self._name(key)
            if name is None:
                raise InvalidKey(
                    f"{self!r}: keys are limited to {names.MAX_KEY_BYTES} bytes of UTF-8"
                )
            meta = names.key_metadata(key, KEY_META) if self._names.is_hashed(name) else {}
            await upload(self._client, name, as_parts(data), meta)

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

    # -- lifecycle ---------------------------------------------------------------------------

    async def close(self) -> None:
        """Wait for operations in flight, then close the client. Idempotent."""
        self._closed = True
        await self._in_flight.wait_idle()
        await self._client.close()

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
        cls, url: str, options: Mapping[str, Any], *, size: int, count: int, concurrency: int
    ) -> tuple[float, float]:
        """(put GB/s, get GB/s) of plain azure-storage-blob (aio): one ``upload_blob`` and one
        ``download_blob().readall()`` per object, on a client configured like the connector's
        (its transfer sizes and concurrency included)."""
        location, opts = parse(url, options)
        service = new_service(location, opts, credential(opts))
        data = os.urandom(size)
        base = f"{location.prefix}kvgate-baseline/{uuid.uuid4().hex[:12]}-"
        async with service:
            container = service.get_container_client(location.container)

            async def put(i: int) -> object:
                return await container.upload_blob(
                    f"{base}{i}", data, overwrite=True, max_concurrency=opts.max_concurrency
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
