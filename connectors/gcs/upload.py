"""Writing one object atomically: one upload when small, parts composed at the end when large.

GCS makes an object visible only when its upload completes, so a reader sees the old object or
the new one. Up to ``put_threshold`` an object is one media upload (a multipart one when the
key must ride in metadata, or the object is empty) whose body is views of the caller's buffers
(``PartsBody``). A larger object is uploaded as up to 32 temporary parts in parallel
(``part_size``, grown to fit 32), named ``<prefix>~kvgate-parts/<nonce>/<n>`` (no key maps to
such a name, so ``list`` skips them), then composed into the object in one request that also
sets its metadata: the object appears whole at the compose. The parts are deleted afterwards,
also when the put fails; a cancelled put deletes them in the background (``close()`` waits).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import Awaitable, Callable, Sequence

from connectors.fanout import limited, run_all, slice_parts, spans
from connectors.gcs.client import GcsClient
from connectors.gcs.config import MAX_COMPONENTS
from connectors.gcs.errors import gcs_errors
from connectors.object_names import shown
from connectors.parts_body import PartsBody

PARTS_DIR = "~kvgate-parts/"
_BOUNDARY = "kvgate-f0a6c7e1d2b34c5a"


async def upload(
    client: GcsClient, name: str, parts: Sequence[memoryview], metadata: dict[str, str]
) -> None:
    opts = client.options
    size = sum(p.nbytes for p in parts)
    where = f"{client.where} PUT {shown(name)}"
    with gcs_errors(where, client.bucket):
        if size <= opts.put_threshold:
            await _upload_one(client, name, parts, metadata)
            return
        part_size = max(opts.part_size, -(-size // MAX_COMPONENTS))
        base = f"{client.location.prefix}{PARTS_DIR}{uuid.uuid4().hex}/"
        ranges = spans(0, size, part_size)
        temps = [f"{base}{i:02d}" for i in range(len(ranges))]
        slots = asyncio.Semaphore(opts.max_concurrency)

        def send(temp: str, lo: int, hi: int) -> Callable[[], Awaitable[None]]:
            return limited(slots, lambda: _upload_one(client, temp, slice_parts(parts, lo, hi), {}))

        try:
            await run_all([send(t, lo, hi) for t, (lo, hi) in zip(temps, ranges, strict=True)])
            await _compose(client, name, temps, metadata)
        except asyncio.CancelledError:
            client.spawn(_delete_all(client, temps))
            raise
        except BaseException:
            await asyncio.shield(client.spawn(_delete_all(client, temps)))
            raise
        client.spawn(_delete_all(client, temps))


async def _upload_one(
    client: GcsClient, name: str, parts: Sequence[memoryview], metadata: dict[str, str]
) -> None:
    opts = client.options
    session = await client.session()
    headers = await client.headers()
    size = sum(p.nbytes for p in parts)
    if metadata or size == 0:
        # multipart/related: the object's resource (name and metadata), then its bytes. An
        # empty object goes this way too: gcp-storage-emulator fails an empty media upload,
        # and GCS takes either.
        resource = json.dumps({"name": name, "metadata": metadata}).encode()
        head = (
            (f"--{_BOUNDARY}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n").encode()
            + resource
            + (f"\r\n--{_BOUNDARY}\r\nContent-Type: application/octet-stream\r\n\r\n").encode()
        )
        tail = f"\r\n--{_BOUNDARY}--\r\n".encode()
        body = PartsBody([memoryview(head), *parts, memoryview(tail)])
        params = {"uploadType": "multipart"}
        content_type = f"multipart/related; boundary={_BOUNDARY}"
    else:
        body = PartsBody(parts)
        params = {"uploadType": "media", "name": name}
        content_type = "application/octet-stream"
    headers.update({"Content-Type": content_type, "Content-Length": str(len(body))})
    async with asyncio.timeout(opts.request_timeout):
        resp = await session.post(
            client.upload_url(),
            headers=headers,
            data=body,  # type: ignore[arg-type]  # a Payload: aiohttp streams it as it is
            timeout=opts.request_timeout,
            params=params,
        )
        await resp.read()


async def _compose(
    client: GcsClient, name: str, sources: Sequence[str], metadata: dict[str, str]
) -> None:
    session = await client.session()
    headers = await client.headers()
    destination: dict[str, object] = {"contentType": "application/octet-stream"}
    if metadata:
        destination["metadata"] = metadata
    body = json.dumps(
        {"sourceObjects": [{"name": s} for s in sources], "destination": destination}
    ).encode()
    headers.update({"Content-Type": "application/json; charset=UTF-8"})
    async with asyncio.timeout(client.options.request_timeout):
        resp = await session.post(
            f"{client.object_url(name)}/compose",
            headers=headers,
            data=body,
            timeout=client.options.request_timeout,
            params={},
        )
        await resp.read()


async def _delete_all(client: GcsClient, names: Sequence[str]) -> None:
    """Delete temporary parts; one that is gone already, or a server that is down, is fine (a
    part left behind is never read; a bucket lifecycle rule on the parts' prefix removes it)."""
    session = await client.session()
    headers = await client.headers()

    async def delete(name: str) -> None:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(client.options.request_timeout):
                resp = await session.delete(
                    client.object_url(name),
                    headers=headers,
                    timeout=client.options.request_timeout,
                    params={},
                )
                await resp.read()

    await asyncio.gather(*(delete(n) for n in names))
