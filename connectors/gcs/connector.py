"""The ``gs://`` connector: ``GcsConnector`` (see the package docstring for the design)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, ClassVar, Self

import aiohttp
from gcloud.aio.storage import Storage

from connectors import object_names as names
from connectors.gcs.client import GcsClient
from connectors.gcs.config import api_root, parse
from connectors.gcs.download import download
from connectors.gcs.errors import gcs_errors, is_missing
from connectors.gcs.upload import upload
from connectors.object_store import OBJECT_STORE_CAPABILITIES, ObjectStoreConnector
from gateway.client_baseline import baseline_objects, timed_put_get
from gateway.connector import Allocator
from gateway.types import ObjectInfo


class GcsConnector(ObjectStoreConnector):
    scheme: ClassVar[str] = "gs"
    capabilities = OBJECT_STORE_CAPABILITIES

    def __init__(self, url: str, **options: Any) -> None:
        self.location, self.options = parse(url, options)
        self.bucket = self.location.bucket
        self.batch_concurrency = self.options.batch_concurrency
        self._track_objects(self.location.prefix)
        self._client = GcsClient(self.location, self.options, repr(self))

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Self:
        return cls(url, **options)

    def __repr__(self) -> str:
        endpoint = f" at {self.options.endpoint}" if self.options.endpoint else ""
        return f"GcsConnector(gs://{self.bucket}/{self.location.prefix}{endpoint})"

    # -- the object-store hooks --------------------------------------------------------------

    async def _download(self, name: str, alloc: Allocator) -> memoryview | None:
        return await download(self._client, name, alloc)

    async def _stat(self, name: str) -> dict[str, Any] | None:
        return await self._metadata(name)

    async def _upload(self, name: str, parts: list[memoryview], meta: dict[str, str]) -> None:
        await upload(self._client, name, parts, meta)

    async def _close_client(self) -> None:
        await self._client.close()

    async def _metadata(self, name: str) -> dict[str, Any] | None:
        with gcs_errors(f"{self!r} HEAD {names.shown(name)}", self.bucket):
            session = await self._client.session()
            headers = await self._client.headers()
            try:
                async with asyncio.timeout(self.options.request_timeout):
                    resp = await session.get(
                        self._client.object_url(name),
                        headers=headers,
                        timeout=self.options.request_timeout,
                        params={"alt": "json"},
                    )
                    found: dict[str, Any] = await resp.json(content_type=None)
            except aiohttp.ClientResponseError as exc:
                if is_missing(exc):
                    return None
                raise
            return found

    # -- writes ------------------------------------------------------------------------------

    async def delete(self, key: str) -> bool:
        """Delete ``key``; whether it existed (GCS answers 404 when it did not)."""
        with self._op():
            name = self._name(key)
            if name is None:
                return False
            with gcs_errors(f"{self!r} DELETE {names.shown(name)}", self.bucket):
                session = await self._client.session()
                headers = await self._client.headers()
                try:
                    async with asyncio.timeout(self.options.request_timeout):
                        resp = await session.delete(
                            self._client.object_url(name),
                            headers=headers,
                            timeout=self.options.request_timeout,
                            params={},
                        )
                        await resp.read()
                except aiohttp.ClientResponseError as exc:
                    if is_missing(exc):
                        return False
                    raise
            return True

    # -- listing (last: ``list`` would shadow the builtin in annotations below it) -----------

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        """Every stored key starting with ``prefix``, with its size, a page at a time; the
        listing carries each object's metadata, so a hashed key costs no extra request."""
        params = {"prefix": self._names.list_prefix(prefix)}
        while True:
            with self._op():  # not held across a yield: a consumer may pause or stop anywhere
                with gcs_errors(f"{self!r} LIST {prefix!r}", self.bucket):
                    storage = await self._client.storage()
                    async with asyncio.timeout(self.options.request_timeout):
                        page = await storage.list_objects(
                            self.bucket,
                            params=dict(params),
                            timeout=int(self.options.request_timeout),
                        )
                found = []
                for item in page.get("items", ()):
                    key = self._key_of(str(item["name"]), item.get("metadata") or {})
                    if key is not None and key.startswith(prefix):
                        found.append(ObjectInfo(key, int(item["size"])))
            for info in found:
                yield info
            token = page.get("nextPageToken")
            if not token:
                return
            params["pageToken"] = str(token)

    def _key_of(self, name: str, metadata: dict[str, str]) -> str | None:
        if not self._names.is_hashed(name):
            return self._names.key_of(name)
        key = names.key_from_metadata(metadata)
        # Only an object of ours: its name is the one its key maps to (never a temporary part).
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
        """(put GB/s, get GB/s) of plain gcloud-aio-storage: one ``upload`` and one
        ``download`` per object (the library picks simple or resumable uploads itself)."""
        location, opts = parse(url, options)
        root, emulated = api_root(opts)
        objects = baseline_objects(size, payloads)
        base = f"{location.prefix}kvgate-baseline/{uuid.uuid4().hex[:12]}-"
        timeout = int(opts.request_timeout)
        async with Storage(
            service_file=opts.service_file, api_root=root, api_is_dev=emulated
        ) as storage:

            async def put(i: int) -> object:
                return await storage.upload(
                    location.bucket, f"{base}{i}", objects[i % len(objects)], timeout=timeout
                )

            async def get(i: int) -> int:
                got = await storage.download(location.bucket, f"{base}{i}", timeout=timeout)
                return len(got)

            try:
                with gcs_errors("gs baseline", location.bucket):
                    return await timed_put_get(
                        put, get, size=size, count=count, concurrency=concurrency
                    )
            finally:
                for i in range(count):
                    with contextlib.suppress(Exception):
                        await storage.delete(location.bucket, f"{base}{i}")
