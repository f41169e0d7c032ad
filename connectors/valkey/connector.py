"""``valkey://``, ``valkeys://``, ``valkey+cluster://`` — Valkey through the valkey-glide client.

Layout under the namespace (option ``namespace``, default ``kvgate:``)::

    {ns}o:{utf-8 key}      the object: inline value, or the manifest of a large one
    {ns}p:{gen}:{i}        part i of a large object (gen: 16 random bytes in hex)

Atomicity and large objects come from ``gateway.parts.StripedObjects``: an object up to
``inline_max`` bytes (default: 4 MiB) is one value; a larger one is written as
``part_size`` parts in parallel, each with a pending expiry, then committed by one transaction
that swaps the main key to its manifest, and the parts are made durable (PERSIST, or the
object's ``ttl`` plus the pending margin). A reader sees the old object or the new one whole,
and a part that went missing (evicted, expired, deleted) makes the read a miss. The parts of
an overwritten or deleted object are deleted by the writer that replaced it. In a cluster the
parts spread over slots (and nodes); each is read and written by its own request, in parallel.
``exists`` looks at the main key only: an object whose parts the server evicted still exists,
and its ``get`` is a miss. Defaults (1 MiB parts, 2 clients, 16 part requests in flight) come
from measurements, see ``config.ValkeyOptions``.

Keys are the UTF-8 bytes of the key string (lone surrogates pass through), so every key maps
to its own server key and ``list`` decodes them back; SCAN MATCH patterns escape glob
characters. Sizes for ``list`` come from the head of each main value (GETRANGE + STRLEN).

Timeouts: every glide request has ``request_timeout`` (default 30 s, not glide's 250 ms) and
carries at most one part or one inline object; connecting has ``connect_timeout``. The Store's
tier timeout bounds whole operations. Glide's exceptions become kvgate's error kinds in one
place, ``client.glide_errors``.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, ClassVar, Self, cast

from glide import (
    Batch,
    ClusterBatch,
    ClusterScanCursor,
    GlideClusterClient,
    GlideError,
    Script,
)

from connectors._options import parse_options
from connectors.valkey.client import (
    Client,
    GlideParts,
    GlidePool,
    close_quietly,
    create_client,
    glide_errors,
)
from connectors.valkey.config import (
    MIN_PART_SIZE,
    Endpoint,
    ValkeyOptions,
    glide_config,
    parse_endpoint,
)
from gateway.client_baseline import baseline_objects, timed_put_get
from gateway.connector import Allocator, BaseConnector
from gateway.errors import GatewayError
from gateway.parts import INLINE, MalformedValue, StripedObjects, size_of
from gateway.types import Buffer, BufferParts, Capabilities, ObjectInfo

log = logging.getLogger(__name__)
_GLOB_SPECIAL = frozenset(b"*?[]\\")
SCAN_COUNT = 1000


# EXISTS of each key, as a list of 0/1 in key order (scripts get their keys as KEYS).
_EXISTS_EACH = Script(  # type: ignore[no-untyped-call]
    "local r = {} for i, k in ipairs(KEYS) do r[i] = redis.call('EXISTS', k) end return r"
)
# How a server says no to scripts: an ACL without EVALSHA, EVAL renamed away, scripting off.
_SCRIPT_REFUSALS = ("NOPERM", "UNKNOWN COMMAND", "DISABLED")
_SCRIPT_KEYS = 4096  # keys per script call: a call blocks the server for about a millisecond


def _flags(replies: object, count: int, target: str) -> builtins.list[bool]:
    if not isinstance(replies, list) or len(replies) != count:
        raise GatewayError(f"{target}: EXISTS of {count} keys went unanswered")
    return [bool(n) for n in replies]


def glob_escape(raw: bytes) -> bytes:
    """``raw`` as a SCAN MATCH pattern that matches exactly these bytes."""
    return bytes(b for c in raw for b in ((0x5C, c) if c in _GLOB_SPECIAL else (c,)))


def encode_key(key: str) -> bytes:
    return key.encode("utf-8", "surrogatepass")


def decode_key(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogatepass")


class ValkeyConnector(BaseConnector):
    scheme: ClassVar[str] = "valkey"

    def __init__(self, endpoint: Endpoint, options: ValkeyOptions) -> None:
        self.endpoint = endpoint
        self.options = options
        namespace = options.namespace.encode()
        self._objects_prefix = namespace + b"o:"
        self._pool = GlidePool(endpoint, options)
        self._parts = GlideParts(self._pool, options.concurrency)
        self._striped = StripedObjects(
            self._parts,
            parts_prefix=namespace + b"p:",
            part_size=options.part_size,
            inline_max=options.inline_limit,
            min_part_size=MIN_PART_SIZE,
        )
        self.capabilities = Capabilities(batch=True, list=True, ttl=True, persistent=True)
        self._scripts = True  # exists_many by script, until the server refuses one

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Self:
        opts = parse_options(ValkeyOptions, url, options)
        return cls(parse_endpoint(url, opts), opts)

    def __repr__(self) -> str:
        return f"ValkeyConnector({self.endpoint.display})"

    def main_key(self, key: str) -> bytes:
        """The server key of ``key``'s object (its inline value or manifest)."""
        return self._objects_prefix + encode_key(key)

    # -- the contract ---------------------------------------------------------------------

    async def get(self, key: str) -> Buffer | None:
        return await self._striped.get(self.main_key(key))

    async def get_into(self, key: str, alloc: Allocator) -> memoryview | None:
        """Into ``alloc``'s buffer, with one copy per part (glide returns ``bytes``)."""
        return await self._striped.get_into(self.main_key(key), alloc)

    async def put(self, key: str, data: BufferParts) -> None:
        await self._striped.put(self.main_key(key), data, self.options.ttl)

    async def exists(self, key: str) -> bool:
        main = self.main_key(key)
        client = await self._pool.client()
        with glide_errors(self._pool.target):
            return await client.exists([main]) > 0

    async def exists_many(self, keys: Sequence[str]) -> builtins.list[bool]:
        """One reply per key. On one server, a Lua script answers ``_SCRIPT_KEYS`` keys a
        call (glide builds each command of a batch in Python: 1024 EXISTS in a batch took
        10-20 ms, the script 3-4 ms); a server that refuses scripts (ACLs, managed services)
        gets the batch from then on. A cluster's keys spread over slots, which one script
        cannot span: a non-atomic batch, which glide sends each node its share of."""
        if not keys:
            return []
        mains = [self.main_key(k) for k in keys]
        client = await self._pool.client()
        if self._scripts and not isinstance(client, GlideClusterClient):
            try:
                flags: builtins.list[bool] = []
                for start in range(0, len(mains), _SCRIPT_KEYS):
                    chunk = mains[start : start + _SCRIPT_KEYS]
                    replies = await client.invoke_script(_EXISTS_EACH, keys=chunk)
                    flags += _flags(replies, len(chunk), self._pool.target)
                return flags
            except GlideError as exc:
                if not any(code in str(exc).upper() for code in _SCRIPT_REFUSALS):
                    with glide_errors(self._pool.target):
                        raise  # as its kvgate kind
                log.info("%r: EXISTS by script refused (%s); batches from now on", self, exc)
                self._scripts = False
        return _flags(await self._batch_exists(client, mains), len(mains), self._pool.target)

    async def _batch_exists(self, client: Client, mains: builtins.list[bytes]) -> object:
        def queue(batch: Any) -> None:  # a Batch or a ClusterBatch: the same methods
            for main in mains:
                batch.exists([main])

        with glide_errors(self._pool.target):
            if isinstance(client, GlideClusterClient):
                cluster_batch = ClusterBatch(is_atomic=False)
                queue(cluster_batch)
                return await client.exec(cluster_batch, raise_on_error=True)
            batch = Batch(is_atomic=False)
            queue(batch)
            return await client.exec(batch, raise_on_error=True)

    async def delete(self, key: str) -> bool:
        return await self._striped.delete(self.main_key(key))

    async def ping(self) -> bool:
        client = await self._pool.client()
        with glide_errors(self._pool.target):
            await client.ping()
        return True

    async def close(self) -> None:
        await self._pool.close()

    # -- listing --------------------------------------------------------------------------

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        pattern = glob_escape(self._objects_prefix + encode_key(prefix)) + b"*"
        seen: set[bytes] = set()  # SCAN may return a key more than once
        async for page in self._scan(pattern):
            fresh = [k for k in page if k not in seen]
            seen.update(fresh)
            sizes = await self._bounded([self._listed_size(k) for k in fresh])
            for raw, size in zip(fresh, sizes, strict=True):
                if size is not None:
                    yield ObjectInfo(decode_key(raw[len(self._objects_prefix) :]), size)

    async def _scan(self, pattern: bytes) -> AsyncIterator[builtins.list[bytes]]:
        client = await self._pool.client()
        target = self._pool.target
        if isinstance(client, GlideClusterClient):
            cursor = ClusterScanCursor()  # type: ignore[no-untyped-call]
            while not cursor.is_finished():
                with glide_errors(target):
                    step = await client.scan(cursor, match=pattern, count=SCAN_COUNT)
                cursor = cast(ClusterScanCursor, step[0])
                yield cast(builtins.list[bytes], step[1])
            return
        position: bytes = b"0"
        while True:
            with glide_errors(target):
                page = await client.scan(position, match=pattern, count=SCAN_COUNT)
            position = cast(bytes, page[0])
            yield cast(builtins.list[bytes], page[1])
            if position == b"0":
                return

    async def _listed_size(self, main: bytes) -> int | None:
        """The object size under ``main``; None if it is gone or not one of ours."""
        head, length = await self._parts.head_and_length(main)
        if length == 0:
            return None  # deleted since the scan (a stored value always has its tag byte)
        try:
            return length - 1 if head[0] == INLINE else size_of(head)
        except MalformedValue:
            return None

    # -- benchmark baseline ---------------------------------------------------------------

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
        """(put GB/s, get GB/s) of plain glide: one SET and one GET per object on one client,
        with ``request_timeout`` from the options (glide's 250 ms would fail large values)."""
        opts = parse_options(ValkeyOptions, url, options)
        endpoint = parse_endpoint(url, opts)
        client: Client = await create_client(glide_config(endpoint, opts), endpoint.display)
        objects = baseline_objects(size, payloads)
        keys = [f"kvgate-baseline/{uuid.uuid4().hex}/{i}" for i in range(count)]

        async def get(i: int) -> int | None:
            value = await client.get(keys[i])
            return None if value is None else len(value)

        try:
            with glide_errors(endpoint.display):
                rates = await timed_put_get(
                    lambda i: client.set(keys[i], objects[i % len(objects)]),
                    get,
                    size=size,
                    count=count,
                    concurrency=concurrency,
                )
                await asyncio.gather(*(client.delete([k]) for k in keys))
        finally:
            await close_quietly(client)
        return rates
