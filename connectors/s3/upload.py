"""Writing one object atomically: one PutObject when small, a multipart upload when large.

S3 makes an object visible only when its write completes: a PutObject whole, a multipart
upload at ``CompleteMultipartUpload``. So a reader sees the old object or the new one, never a
part. Above ``multipart_threshold`` the parts (``part_size``, grown when an object would need
more than 10,000) are uploaded in parallel, then completed; parts and ranged reads share the
connector's ``max_concurrency`` slots.

A failed upload is aborted before the error reaches the caller, so no parts are left behind to
be billed. A cancelled one (a tier timeout) is aborted in the background instead, so that the
cancellation is not held up by a request to a server that may be gone; ``close()`` waits for
those aborts. An abort that fails too (the server is down), or one that never ran (the
process died), leaves the upload to the connector's sweep (``sweep.py``) or a bucket lifecycle
rule (``AbortIncompleteMultipartUpload``). Uploads in progress are in ``client.uploads``, so
that this connector's sweep never aborts them.

Bodies are views of the caller's buffers (``PartsBody``): nothing is joined or copied, also
for a part that straddles two of them (the frame header and the payload). Their SigV4
payload hashes are computed in a thread before the request (``signing``).
Each request is bounded by ``request_timeout``; one moves at most one part, or one object under
the threshold.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from connectors.object_names import shown
from connectors.s3.client import S3Client
from connectors.s3.config import MAX_PARTS
from connectors.s3.errors import code_of, s3_errors
from connectors.s3.signing import prehashed_body
from connectors.s3.transfer import limited, run_all, slice_parts, spans

log = logging.getLogger(__name__)


async def upload(
    client: S3Client, name: str, parts: Sequence[memoryview], metadata: dict[str, str]
) -> None:
    opts = client.options
    size = sum(p.nbytes for p in parts)
    where = f"{client.where} PUT {shown(name)}"
    with s3_errors(where, client.bucket):
        s3 = await client.get()
        if size <= opts.multipart_threshold:
            body = await prehashed_body(parts)
            async with asyncio.timeout(opts.request_timeout):
                await s3.put_object(Bucket=client.bucket, Key=name, Body=body, Metadata=metadata)
            return
        async with asyncio.timeout(opts.request_timeout):
            created = await s3.create_multipart_upload(
                Bucket=client.bucket, Key=name, Metadata=metadata
            )
        upload_id: str = created["UploadId"]
        client.uploads.add(upload_id)
        try:
            await _upload_parts(client, s3, name, upload_id, parts, size)
        except asyncio.CancelledError:
            client.spawn(_abort_or_warn(client, s3, name, upload_id))
            raise
        except BaseException:
            await asyncio.shield(client.spawn(_abort_or_warn(client, s3, name, upload_id)))
            raise
        client.uploads.discard(upload_id)


async def _upload_parts(
    client: S3Client, s3: Any, name: str, upload_id: str, parts: Sequence[memoryview], size: int
) -> None:
    opts = client.options
    part_size = max(opts.part_size, -(-size // MAX_PARTS))

    def job(number: int, lo: int, hi: int) -> Any:
        async def send() -> dict[str, Any]:
            body = await prehashed_body(slice_parts(parts, lo, hi))
            async with asyncio.timeout(opts.request_timeout):
                sent = await s3.upload_part(
                    Bucket=client.bucket,
                    Key=name,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=body,
                )
            return {"PartNumber": number, "ETag": sent["ETag"]}

        return send

    jobs = [
        limited(client.slots, job(n, lo, hi))
        for n, (lo, hi) in enumerate(spans(0, size, part_size), start=1)
    ]
    done = await run_all(jobs)
    async with asyncio.timeout(opts.request_timeout):
        await s3.complete_multipart_upload(
            Bucket=client.bucket, Key=name, UploadId=upload_id, MultipartUpload={"Parts": done}
        )


async def abort(client: S3Client, s3: Any, name: str, upload_id: str) -> Exception | None:
    """Abort an upload; the error if that failed (an upload already gone is not one)."""
    try:
        async with asyncio.timeout(client.options.request_timeout):
            await s3.abort_multipart_upload(Bucket=client.bucket, Key=name, UploadId=upload_id)
    except Exception as exc:
        # NoSuchUpload: a cancelled complete went through after all, or another sweep was first
        return None if code_of(exc) == "NoSuchUpload" else exc
    return None


async def _abort_or_warn(client: S3Client, s3: Any, name: str, upload_id: str) -> None:
    try:
        error = await abort(client, s3, name, upload_id)
    finally:
        client.uploads.discard(upload_id)  # now the sweep's, if the abort failed
    if error is not None:
        log.warning(
            "%s: could not abort multipart upload %s of %s (%s: %s); its parts stay until a "
            "sweep or a lifecycle rule removes them",
            client.where,
            upload_id,
            shown(name),
            type(error).__name__,
            error,
        )
