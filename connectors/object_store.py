"""What the object-store connectors (``s3://``, ``azure://``, ``gs://``) share: keys as object
names (``object_names``), operations tracked so that ``close`` waits for them, and ``get``,
``get_into``, ``exists``, ``put`` and ``close`` written once over four hooks each store fills
in with its own client: ``_download``, ``_stat``, ``_upload`` and ``_close_client``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from connectors import object_names as names
from gateway.connector import Allocator, BaseConnector, as_parts
from gateway.errors import GatewayError, InvalidKey
from gateway.inflight import InFlight
from gateway.types import Buffer, BufferParts, Capabilities

OBJECT_STORE_CAPABILITIES = Capabilities(
    list=True, zero_copy=True, persistent=True, max_key_length=names.MAX_KEY_BYTES
)


def _no_buffer(size: int) -> memoryview | None:
    return None  # the read then fills a buffer of its own


class ObjectStoreConnector(BaseConnector):
    """A connector whose keys are object names under a prefix. Subclasses call
    ``_track_objects(prefix)`` in ``__init__`` and implement the hooks."""

    key_meta: str = names.KEY_META
    """The metadata entry that holds a hashed (very long) key's text."""

    def _track_objects(self, prefix: str) -> None:
        self._names = names.Naming(prefix)
        self._in_flight = InFlight()
        self._closed = False

    @contextlib.contextmanager
    def _op(self) -> Iterator[None]:
        """One operation: refused once closed, waited for by ``close``."""
        if self._closed:
            raise GatewayError(f"{self!r} is closed")
        with self._in_flight.track():
            yield

    def _name(self, key: str) -> str | None:
        """The object name of ``key``; None if the key is too long to be stored."""
        if not key:
            raise InvalidKey("a key must not be empty")
        if len(key.encode()) > names.MAX_KEY_BYTES:
            return None
        return self._names.object_name(key)

    def object_name(self, key: str) -> str | None:
        """The name ``key``'s object has in the store (None: a key too long to be stored)."""
        return self._name(key)

    # -- the hooks ---------------------------------------------------------------------------

    async def _download(self, name: str, alloc: Allocator) -> memoryview | None:
        """The object named ``name`` read into ``alloc(size)`` (or a buffer of its own when
        alloc says no); None when there is none."""
        raise NotImplementedError

    async def _stat(self, name: str) -> Any:
        """The object's properties (whatever the store answers), or None when there is none."""
        raise NotImplementedError

    async def _upload(self, name: str, parts: list[memoryview], meta: dict[str, str]) -> None:
        """Store ``parts`` (concatenated) under ``name`` with metadata ``meta``, atomically."""
        raise NotImplementedError

    async def _close_client(self) -> None:
        raise NotImplementedError

    # -- the connector -----------------------------------------------------------------------

    async def get(self, key: str) -> Buffer | None:
        got = await self.get_into(key, _no_buffer)
        return got.obj if got is not None and isinstance(got.obj, bytearray) else got

    async def get_into(self, key: str, alloc: Allocator) -> memoryview | None:
        with self._op():
            name = self._name(key)
            if name is None:
                return None
            return await self._download(name, alloc)

    async def exists(self, key: str) -> bool:
        with self._op():
            name = self._name(key)
            return name is not None and await self._stat(name) is not None

    async def put(self, key: str, data: BufferParts) -> None:
        with self._op():
            name = self._name(key)
            if name is None:
                raise InvalidKey(
                    f"{self!r}: keys are limited to {names.MAX_KEY_BYTES} bytes of UTF-8"
                )
            hashed = self._names.is_hashed(name)
            meta = names.key_metadata(key, self.key_meta) if hashed else {}
            await self._upload(name, as_parts(data), meta)

    async def close(self) -> None:
        """Wait for operations in flight (and their clean-ups), then close the client.
        Idempotent."""
        self._closed = True
        await self._in_flight.wait_idle()
        await self._close_client()
