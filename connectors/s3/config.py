"""Options of ``s3://bucket/prefix`` and the parsing of its URL.

The URL names only the bucket and a key prefix; everything else (endpoint, credentials, sizes,
timeouts) is a typed option, so that one strict model validates it. Credentials that are not
given here come from botocore's standard chain (``AWS_ACCESS_KEY_ID`` and friends, shared
config files, instance roles), which is what operators of S3 clients expect.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field

from connectors._options import parse_options
from connectors.s3_access import Location, S3AccessOptions, parse_bucket_url
from gateway.config import ByteSize

MiB = 1 << 20
MIN_PART_SIZE = 5 * MiB
"""S3 rejects multipart parts smaller than this (all but the last part)."""
MAX_PARTS = 10_000
DEFAULT_STALE_UPLOAD_AGE = 3600.0
"""An hour: longer than any upload of a live gateway, so a sweep aborts only dead ones."""
MAX_SWEEP_PERIOD = 30 * 86400.0
"""Longest period between sweeps of stale multipart uploads (asyncio sleeps are bounded)."""


class S3Options(S3AccessOptions):
    read_timeout: float = Field(
        default=30.0, gt=0, description="longest silence on a socket while a request runs"
    )
    request_timeout: float = Field(
        default=120.0,
        gt=0,
        description="one whole HTTP request; a request moves at most one part, one range, or "
        "one object under the thresholds, so this bounds a large object per piece",
    )
    # Objects up to 32 MiB move in one request each way: on a local S3 server (MinIO,
    # SeaweedFS) more streams per object only add overhead at that size. Larger objects go in
    # parallel pieces. A remote S3 that caps each connection's speed wants smaller values.
    multipart_threshold: ByteSize = Field(default=32 * MiB, gt=0)
    part_size: ByteSize = Field(default=8 * MiB, ge=MIN_PART_SIZE)
    ranged_get_threshold: ByteSize = Field(default=32 * MiB, gt=0)
    range_size: ByteSize = Field(default=16 * MiB, gt=0)
    max_concurrency: int = Field(
        default=8, ge=1, description="multipart parts and GET ranges in flight, connector-wide"
    )
    max_pool_connections: int = Field(default=64, ge=1)
    max_attempts: int = Field(
        default=1, ge=1, description="botocore's own attempts; the tier has a retry layer"
    )
    create_bucket: bool = False
    check_bucket: bool = Field(
        default=True,
        description="HEAD the bucket on first use (fails fast on a wrong bucket or secret; "
        "needs s3:ListBucket)",
    )
    batch_concurrency: int = Field(default=16, ge=1)
    abort_uploads_older_than: float | None = Field(
        default=DEFAULT_STALE_UPLOAD_AGE,
        ge=0,
        allow_inf_nan=False,
        description="seconds: multipart uploads of this tier's object names under the prefix "
        "that were initiated longer ago are aborted (left by puts that died with their "
        "process), once the client starts and every abort_uploads_every seconds; 0: every one "
        "but this connector's own in flight; None: never. Keep it above the longest upload of "
        "any gateway sharing the prefix, plus the clock skew to the server",
    )
    abort_uploads_every: float | None = Field(
        default=3600.0,
        gt=0,
        le=MAX_SWEEP_PERIOD,
        allow_inf_nan=False,
        description="seconds between those sweeps, after the first; None: only the first",
    )


def parse_url(url: str) -> Location:
    return parse_bucket_url(url, "s3")


def parse(url: str, options: Mapping[str, Any]) -> tuple[Location, S3Options]:
    location = parse_url(url)
    return location, parse_options(S3Options, url, options)
