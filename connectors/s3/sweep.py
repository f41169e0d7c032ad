"""Aborting the multipart uploads that nobody will complete.

A put that dies with its process (SIGKILL, a crash, a server restart mid-upload) leaves its
multipart upload behind, and S3 keeps (and bills) its parts until someone aborts it. So the
connector sweeps: once its client has started (the first operation), then every
``abort_uploads_every`` seconds, in one background task that ``close()`` cancels, it aborts
the uploads under its prefix that were initiated more than ``abort_uploads_older_than``
seconds ago.

Only uploads that are surely this tier's are candidates: the listing asks for the prefix, and
each name is checked again here against the names the connector writes (``Naming.is_ours``),
so neither a server that ignores ``Prefix`` nor another application's uploads under the same
prefix lose anything. The connector's own uploads in flight are skipped whatever their age.
Uploads of another live gateway on the same prefix are protected by the age alone, which is
why the default is an hour.

Bounds: a sweep lists at most MAX_PAGES pages of PAGE_SIZE uploads (what is left waits for
the next sweep), one request at a time, each under ``request_timeout``. A sweep that fails
(S3 down, no permission for ListMultipartUploads) is one warning; the tier works on and the
next sweep tries again.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime, timedelta
from typing import Any

from connectors.object_names import Naming
from connectors.s3.client import S3Client
from connectors.s3.errors import s3_errors
from connectors.s3.upload import abort

log = logging.getLogger(__name__)

PAGE_SIZE = 1000  # S3's largest page of ListMultipartUploads
MAX_PAGES = 10


async def sweep(client: S3Client, naming: Naming, max_age: float) -> int:
    """Abort this tier's uploads initiated more than ``max_age`` seconds ago; how many."""
    s3 = await client.get()
    opts = client.options
    cutoff = datetime.now(UTC) - timedelta(seconds=max_age)
    request: dict[str, Any] = {"Bucket": client.bucket, "Prefix": naming.prefix}
    where = f"{client.where} ListMultipartUploads"
    aborted = failed = 0
    for _ in range(MAX_PAGES):
        with s3_errors(where, client.bucket):
            async with asyncio.timeout(opts.request_timeout):
                page = await s3.list_multipart_uploads(**request, MaxUploads=PAGE_SIZE)
        for upload in page.get("Uploads") or ():
            name, upload_id = upload.get("Key"), upload.get("UploadId")
            if (
                isinstance(name, str)
                and isinstance(upload_id, str)
                and naming.is_ours(name)
                and upload_id not in client.uploads
                and (max_age == 0 or _initiated(upload) <= cutoff)
            ):
                error = await abort(client, s3, name, upload_id)
                aborted += error is None
                failed += error is not None
        markers = _next_page(page)
        if markers is None or all(request.get(k) == v for k, v in markers.items()):
            break  # the last page (or a server that repeats one: no endless loop)
        request.update(markers)
    if aborted or failed:
        log.info(
            "%s: aborted %d stale multipart uploads (%d could not be aborted)",
            client.where,
            aborted,
            failed,
        )
    return aborted


def _initiated(upload: dict[str, Any]) -> datetime:
    """When the upload started; the far future when S3 does not say (it is then kept)."""
    when = upload.get("Initiated")
    if not isinstance(when, datetime):
        return datetime.max.replace(tzinfo=UTC)
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def _next_page(page: dict[str, Any]) -> dict[str, str] | None:
    """The markers of the next page, or None after the last one.

    S3 continues after (NextKeyMarker, NextUploadIdMarker). SeaweedFS sends no NextKeyMarker:
    its pages are ordered by upload id and continue after NextUploadIdMarker alone.
    """
    if not page.get("IsTruncated"):
        return None
    key, upload_id = page.get("NextKeyMarker"), page.get("NextUploadIdMarker")
    if key:
        return {"KeyMarker": key, **({"UploadIdMarker": upload_id} if upload_id else {})}
    return {"UploadIdMarker": upload_id} if upload_id else None


async def sweep_now_and_then(
    client: S3Client, naming: Naming, max_age: float, every: float | None
) -> None:
    """Sweep, then every ``every`` seconds (None: once); runs until cancelled."""
    while True:
        try:
            await sweep(client, naming, max_age)
        except Exception as exc:  # GatewayError mostly; a sweep never ends the task
            log.warning(
                "%s: could not abort stale multipart uploads (%s: %s); trying again %s",
                client.where,
                type(exc).__name__,
                exc,
                f"in {every:g} s" if every is not None else "at the next start",
            )
        if every is None:
            return
        await asyncio.sleep(every)
