"""The connector's one gcloud-aio-storage client: built on first use, closed by close().

gcloud-aio-storage supplies the credentials (its ``Token``) and the aiohttp session; the
connector builds the few requests it needs that the library's calls cannot make without a
copy or a lost header (a media upload from the caller's buffers, a compose that sets metadata,
a download whose headers give size and generation): ``url``, ``headers`` and ``session`` here.
"""

from __future__ import annotations

import asyncio
import io
import os
from collections.abc import Coroutine
from pathlib import Path
from typing import Any
from urllib.parse import quote

from gcloud.aio.auth import AioSession
from gcloud.aio.storage import Storage

from connectors.gcs.config import GcsOptions, Location, api_root
from connectors.gcs.errors import gcs_errors, is_missing
from gateway.errors import ConfigError


async def credentials_file(service_file: str | None) -> io.StringIO | None:
    """The service file (or ``GOOGLE_APPLICATION_CREDENTIALS``'s) read in a worker thread, so
    that gcloud-aio-auth, which reads it in ``Storage()``, does not read a file on the loop.
    None: no file named; gcloud-aio-auth then looks for the gcloud SDK's own (a small read)."""
    path = service_file or os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    if not path:
        return None
    try:
        text = await asyncio.to_thread(Path(path).read_text, encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"GCS credentials file {path!r}: {exc.strerror or exc}") from None
    return io.StringIO(text)


class GcsClient:
    def __init__(self, location: Location, opts: GcsOptions, where: str) -> None:
        self.location = location
        self.bucket = location.bucket
        self.options = opts
        self.where = where
        self.root, self.emulated = api_root(opts)
        self._storage: Storage | None = None
        self._lock = asyncio.Lock()
        self._background: set[asyncio.Task[None]] = set()

    async def storage(self) -> Storage:
        if self._storage is not None:
            return self._storage
        async with self._lock:
            if self._storage is None:
                storage = Storage(
                    service_file=await credentials_file(self.options.service_file),
                    api_root=self.root,
                    api_is_dev=self.emulated,
                )
                try:
                    if self.options.check_bucket:
                        await self._check_bucket(storage)
                except BaseException:
                    await storage.close()
                    raise
                self._storage = storage
        return self._storage

    async def _check_bucket(self, storage: Storage) -> None:
        where = f"{self.where} BUCKET"
        with gcs_errors(where, self.bucket):
            try:
                async with asyncio.timeout(self.options.request_timeout):
                    await storage.get_bucket_metadata(self.bucket)
            except Exception as exc:
                if is_missing(exc):
                    raise ConfigError(f"{where}: bucket {self.bucket!r} does not exist") from None
                raise

    async def session(self) -> AioSession:
        return (await self.storage()).session

    async def headers(self) -> dict[str, str]:
        """The credential's header (none for an emulator). A token refresh is a network call:
        it gets its own ``request_timeout`` (TimeoutError, mapped by the caller's
        ``gcs_errors``), so a call never waits longer than twice that."""
        storage = await self.storage()
        async with asyncio.timeout(self.options.request_timeout):
            return await storage._headers()

    def object_url(self, name: str) -> str:
        return f"{self.root}/storage/v1/b/{self.bucket}/o/{quote(name, safe='')}"

    def upload_url(self) -> str:
        return f"{self.root}/upload/storage/v1/b/{self.bucket}/o"

    def spawn(self, job: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run a clean-up in the background; ``close()`` waits for it."""
        task = asyncio.ensure_future(job)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def close(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        storage, self._storage = self._storage, None
        if storage is not None:
            await storage.close()
