"""Moving one blob: one Put Blob or staged blocks committed last; one download with ranges.

Puts. Up to ``put_threshold`` a blob is one Put Blob, which Azure makes visible whole. A larger
one is staged as blocks (``block_size``, grown when a blob would need more than 50,000), up
to ``max_concurrency`` at once, and made visible by one Put Block List at the end. Block ids
carry a random nonce per put: the SDK's own chunked upload names blocks by their offset, so two
writers of one blob could commit each other's blocks — a torn object. With nonces, the writer
that commits first wins and the other's commit fails (``InvalidBlockList``: Azure drops the
blob's uncommitted blocks at a commit), which is an ``Unavailable`` the retry layer retries.
Blocks of a put that failed stay uncommitted until Azure drops them (at the blob's next
commit, or after a week); no reader ever sees them. Bodies are views of the caller's buffers
(``PartsBody``), never joined.

Gets. The first GET fetches up to ``ranged_get_threshold`` bytes and tells the blob's size and
ETag; the buffer is allocated then, and the SDK fetches the rest in ``range_size`` ranges, up to
``max_concurrency`` at once, pinned to that ETag with If-Match, writing each straight into its
slice of the buffer. An overwrite during the read fails a range (412); the read starts again,
``CHANGE_RETRIES`` times at most. The client's bytes are copied once into the buffer.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from collections.abc import Sequence

from azure.core.exceptions import HttpResponseError
from azure.storage.blob import BlobBlock

from connectors.azure.client import AzureClient
from connectors.azure.config import MAX_BLOCKS
from connectors.azure.errors import azure_errors, is_changed, is_missing
from connectors.fanout import limited, run_all, slice_parts, spans
from connectors.object_names import shown
from connectors.parts_body import PartsBody
from connectors.read_target import ReadTarget
from gateway.connector import Allocator, read_limit
from gateway.errors import OverReadLimit, Unavailable

CHANGE_RETRIES = 3


async def upload(
    client: AzureClient, name: str, parts: Sequence[memoryview], metadata: dict[str, str]
) -> None:
    opts = client.options
    size = sum(p.nbytes for p in parts)
    where = f"{client.where} PUT {shown(name)}"
    with azure_errors(where, client.location.container, client.secret):
        container = await client.container()
        blob = container.get_blob_client(name)
        if size <= opts.put_threshold:
            # The REST operation under upload_blob: the public call insists on one ``bytes``
            # (a copy of a scatter list, and aiohttp warns about large bytes bodies).
            async with asyncio.timeout(opts.request_timeout):
                await blob._client.block_blob.upload(
                    content_length=size,
                    body=PartsBody(parts),
                    # as upload_blob sends them: the operation's own ``metadata`` is not sent
                    headers={f"x-ms-meta-{k}": v for k, v in metadata.items()},
                )
            return
        block_size = max(opts.block_size, -(-size // MAX_BLOCKS))
        nonce = uuid.uuid4().hex
        ranges = spans(0, size, block_size)
        ids = [base64.b64encode(f"{nonce}-{i:06d}".encode()).decode() for i in range(len(ranges))]
        slots = asyncio.Semaphore(opts.max_concurrency)

        def stage(block_id: str, lo: int, hi: int) -> object:
            async def send() -> None:
                body = PartsBody(slice_parts(parts, lo, hi))
                async with asyncio.timeout(opts.request_timeout):
                    await blob.stage_block(block_id, body, length=hi - lo)  # type: ignore[arg-type]

            return limited(slots, send)

        await run_all([stage(i, lo, hi) for i, (lo, hi) in zip(ids, ranges, strict=True)])  # type: ignore[arg-type]
        async with asyncio.timeout(opts.request_timeout):
            await blob.commit_block_list([BlobBlock(block_id=i) for i in ids], metadata=metadata)


class _BufferWriter:
    """A seekable file over one buffer: where the SDK's parallel download writes its ranges."""

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else self.pos + pos
        return self.pos

    def write(self, data: bytes) -> int:
        end = self.pos + len(data)
        if end > self.buf.nbytes:
            raise Unavailable(f"the download sent more than the {self.buf.nbytes} bytes announced")
        self.buf[self.pos : end] = data
        self.pos = end
        return len(data)


class ObjectChanged(Unavailable):
    """The blob was overwritten or deleted between two ranges of one read."""


async def download(client: AzureClient, name: str, alloc: Allocator) -> memoryview | None:
    """The blob ``name`` in a buffer from ``alloc`` (or a new one); None on a miss."""
    target = ReadTarget(alloc)
    for attempt in range(CHANGE_RETRIES):
        try:
            return await _read_once(client, name, target)
        except ObjectChanged:
            if attempt == CHANGE_RETRIES - 1:
                raise
    raise AssertionError("unreachable")


async def _read_once(client: AzureClient, name: str, target: ReadTarget) -> memoryview | None:
    opts = client.options
    where = f"{client.where} GET {shown(name)}"
    with azure_errors(where, client.location.container, client.secret):
        container = await client.container()
        blob = container.get_blob_client(name)
        async with asyncio.timeout(opts.request_timeout):
            try:
                got = await blob.download_blob(max_concurrency=opts.max_concurrency)
            except HttpResponseError as exc:
                if is_missing(exc):
                    return None
                raise
            size = int(got.size)
            limit = read_limit()
            if limit is not None and size > limit:  # stored there by anyone: never allocated
                raise OverReadLimit(
                    f"{shown(name)} is {size} bytes, over the {limit} a reader takes"
                )
            buf = target.get(size)
            if buf is None:
                return None  # it changed size under a buffer that alloc gave: a miss
            try:
                written = await got.readinto(_BufferWriter(buf))  # type: ignore[arg-type]
            except HttpResponseError as exc:
                if is_changed(exc) or is_missing(exc):
                    raise ObjectChanged(f"{where}: the blob changed during the read") from None
                raise
            if written != size:
                raise Unavailable(f"{where}: the body ended after {written} of {size} bytes")
            return buf
