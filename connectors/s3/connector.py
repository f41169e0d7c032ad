"""The ``s3://`` connector: ``S3Connector`` (see the package docstring for the design)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import uuid
import warnings
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, ClassVar, Self

from botocore.exceptions import ClientError  # type: ignore[import-untyped]

from connectors import object_names as names
from connectors.object_store import OBJECT_STORE_CAPABILITIES, ObjectStoreConnector
from connectors.s3 import sweep
from connectors.s3.client import S3Client, new_session, open_client
from connectors.s3.config import DEFAULT_STALE_UPLOAD_AGE, S3Options, parse
from connectors.s3.download import download
from connectors.s3.errors import is_missing, s3_errors
from connectors.s3.upload import upload
from connectors.s3_access import Location
from gateway.client_baseline import baseline_objects, timed_put_get
from gateway.connector import Allocator
from gateway.errors import ConfigError
from gateway.types import ObjectInfo


class S3Connector(ObjectStoreConnector):
    scheme: ClassVar[str] = "s3"
    capabilities = OBJECT_STORE_CAPABILITIES

    def __init__(self, url: str, **options: Any) -> None:
        location, self.options = parse(url, options)
        self.bucket = location.bucket
        self.prefix = location.prefix
        self.batch_concurrency = self.options.batch_concurrency
        self._track_objects(location.prefix)
        max_age, every = self.options.abort_uploads_older_than, self.options.abort_uploads_every
        janitor = None
        if max_age is not None:
            janitor = functools.partial(
                sweep.sweep_now_and_then, naming=self._names, max_age=max_age, every=every
            )
        self._client = S3Client(location, self.options, repr(self), janitor)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Self:
        return cls(url, **options)

    def __repr__(self) -> str:
        endpoint = f" at {self.options.endpoint_url}" if self.options.endpoint_url else ""
        return f"S3Connector(s3://{self.bucket}/{self.prefix}{endpoint})"

    # -- the object-store hooks --------------------------------------------------------------

    async def _download(self, name: str, alloc: Allocator) -> memoryview | None:
        return await download(self._client, name, alloc)

    async def _stat(self, name: str) -> dict[str, Any] | None:
        return await self._head(name)

    async def _upload(self, name: str, parts: list[memoryview], meta: dict[str, str]) -> None:
        await upload(self._client, name, parts, meta)

    async def _close_client(self) -> None:
        await self._client.close()

    async def _head(self, name: str) -> dict[str, Any] | None:
        where = f"{self!r} HEAD {names.shown(name)}"
        with s3_errors(where, self.bucket):
            s3 = await self._client.get()
            try:
                async with asyncio.timeout(self.options.request_timeout):
                    head: dict[str, Any] = await s3.head_object(Bucket=self.bucket, Key=name)
            except ClientError as exc:
                if is_missing(exc):
                    return None
                raise
            return head

    # -- writes ------------------------------------------------------------------------------

    async def delete(self, key: str) -> bool:
        """Delete ``key``; whether it existed.

        S3's DeleteObject does not say whether there was an object, so a HEAD goes first. A
        put of the key between the two makes that put's object vanish and the answer say it
        existed, which is what a delete just after that put would do anyway.
        """
        with self._op():
            name = self._name(key)
            if name is None or await self._head(name) is None:
                return False
            with s3_errors(f"{self!r} DELETE {names.shown(name)}", self.bucket):
                s3 = await self._client.get()
                async with asyncio.timeout(self.options.request_timeout):
                    await s3.delete_object(Bucket=self.bucket, Key=name)
            return True

    # -- lifecycle ---------------------------------------------------------------------------

    async def abort_stale_uploads(self, older_than: float | None = None) -> int:
        """Sweep now: abort this tier's multipart uploads under the prefix that were initiated
        more than ``older_than`` seconds ago (default: ``abort_uploads_older_than``, or an hour
        when that is None); how many were aborted."""
        if older_than is None:
            older_than = self.options.abort_uploads_older_than
        if older_than is None:
            older_than = DEFAULT_STALE_UPLOAD_AGE
        if not 0 <= older_than < math.inf:
            raise ConfigError(f"older_than must be a number of seconds >= 0, got {older_than!r}")
        with self._op():
            return await sweep.sweep(self._client, self._names, older_than)

    async def ping(self) -> bool:
        await self.exists("kvgate-ping")
        return True

    # -- listing (last: ``list`` would shadow the builtin in annotations below it) -----------

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        """Every stored key starting with ``prefix``, with its size, via ListObjectsV2 pages.

        A hashed (very long) key is read back from its object's metadata with one HEAD.
        """
        request: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self._names.list_prefix(prefix)}
        while True:
            with self._op():  # not held across a yield: a consumer may pause or stop anywhere
                with s3_errors(f"{self!r} LIST {prefix!r}", self.bucket):
                    s3 = await self._client.get()
                    async with asyncio.timeout(self.options.request_timeout):
                        page = await s3.list_objects_v2(**request)
                found = []
                for item in page.get("Contents", ()):
                    key = await self._key_of(str(item["Key"]))
                    if key is not None and key.startswith(prefix):
                        found.append(ObjectInfo(key, int(item["Size"])))
            for info in found:
                yield info
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return
            request["ContinuationToken"] = token

    async def _key_of(self, name: str) -> str | None:
        if not self._names.is_hashed(name):
            return self._names.key_of(name)
        head = await self._head(name)
        key = names.key_from_metadata(head.get("Metadata", {})) if head is not None else None
        # Only an object of ours: its name is the one its key maps to.
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
        """(put GB/s, get GB/s) of plain aioboto3: one put_object and one get_object plus
        ``Body.read()`` per object, on a client configured like the connector's."""
        location, opts = parse(url, options)
        with warnings.catch_warnings():
            # aiohttp warns (ResourceWarning) about every bytes body over 1 MiB; the plain
            # client's way is exactly that, so the warning is expected here, not a fault.
            warnings.filterwarnings("ignore", "Sending a large body", ResourceWarning)
            return await cls._raw_round_trips(location, opts, size, count, concurrency, payloads)

    @staticmethod
    async def _raw_round_trips(
        location: Location,
        opts: S3Options,
        size: int,
        count: int,
        concurrency: int,
        payloads: Sequence[bytes],
    ) -> tuple[float, float]:
        objects = baseline_objects(size, payloads)
        base = f"{location.prefix}kvgate-baseline/{uuid.uuid4().hex[:12]}-"
        keys = [f"{base}{i}" for i in range(count)]
        async with contextlib.AsyncExitStack() as stack:
            s3 = await open_client(new_session(opts), opts, stack)

            async def put(i: int) -> object:
                return await s3.put_object(
                    Bucket=location.bucket, Key=keys[i], Body=objects[i % len(objects)]
                )

            async def get(i: int) -> int:
                resp = await s3.get_object(Bucket=location.bucket, Key=keys[i])
                return len(await resp["Body"].read())

            try:
                return await timed_put_get(
                    put, get, size=size, count=count, concurrency=concurrency
                )
            finally:
                for key in keys:
                    with contextlib.suppress(Exception):
                        await s3.delete_object(Bucket=location.bucket, Key=key)
