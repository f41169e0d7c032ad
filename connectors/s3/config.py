"""Options of ``s3://bucket/prefix`` and the parsing of its URL.

The URL names only the bucket and a key prefix; everything else (endpoint, credentials, sizes,
timeouts) is a typed option, so that one strict model validates it. Credentials that are not
given here come from botocore's standard chain (``AWS_ACCESS_KEY_ID`` and friends, shared
config files, instance roles), which is what operators of S3 clients expect.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import unquote

from pydantic import Field, SecretStr, field_validator, model_validator

from connectors._options import StrictOptions, parse_options, split_url
from gateway.config import ByteSize, redact_url
from gateway.errors import ConfigError

MiB = 1 << 20
MIN_PART_SIZE = 5 * MiB
"""S3 rejects multipart parts smaller than this (all but the last part)."""
MAX_PARTS = 10_000
DEFAULT_STALE_UPLOAD_AGE = 3600.0
"""An hour: longer than any upload of a live gateway, so a sweep aborts only dead ones."""
MAX_SWEEP_PERIOD = 30 * 86400.0
"""Longest period between sweeps of stale multipart uploads (asyncio sleeps are bounded)."""
MAX_PREFIX = 512
"""Bytes of URL prefix: the rest of S3's 1024-byte names is left for the keys."""

# Bucket names as S3 allows them (3-63 chars of lowercase letters, digits, dots and hyphens),
# plus the underscores and capitals that some S3-compatible servers still accept.
_BUCKET_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{1,254}$")


class S3Options(StrictOptions):
    endpoint_url: str | None = Field(
        default=None, description="http(s)://host:port of an S3-compatible server; None = AWS"
    )
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: SecretStr | None = None
    session_token: SecretStr | None = None
    addressing_style: Literal["auto", "path", "virtual"] = Field(
        default="auto", description="MinIO and SeaweedFS need 'path'"
    )
    verify_tls: bool = True
    ca_bundle: str | None = Field(default=None, description="PEM file of CAs to trust")
    connect_timeout: float = Field(default=5.0, gt=0)
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

    @field_validator("endpoint_url")
    @classmethod
    def _check_endpoint(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^https?://[^/?#]+/?$", value):
            raise ValueError("expected http(s)://host[:port] with no path or query")
        return value

    @model_validator(mode="after")
    def _check_credentials(self) -> S3Options:
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ValueError("give access_key_id and secret_access_key together (or neither)")
        if self.session_token is not None and self.access_key_id is None:
            raise ValueError("session_token needs access_key_id and secret_access_key")
        return self

    def __repr_args__(self) -> Any:
        # SecretStr already hides the secrets; the key id is hidden too (config.py's rule).
        for name, value in super().__repr_args__():
            yield name, ("***" if name == "access_key_id" and value else value)


@dataclass(frozen=True, slots=True)
class Location:
    """Where objects live: a bucket and the prefix every object name starts with."""

    bucket: str
    prefix: str
    """"" or a path ending in "/"."""


def parse_url(url: str) -> Location:
    parts = split_url(url, "s3")
    if parts.username is not None or parts.password is not None:
        raise ConfigError(
            f"{redact_url(url)!r}: credentials go in the access_key_id / secret_access_key "
            "options (or the AWS environment), not in the URL"
        )
    bucket = parts.netloc
    if not _BUCKET_RE.match(bucket):
        raise ConfigError(f"{url!r}: expected s3://bucket/prefix with a valid bucket name")
    prefix = unquote(parts.path).strip("/")
    if "//" in prefix or any(p in (".", "..") for p in prefix.split("/") if prefix):
        raise ConfigError(f"{url!r}: the prefix must not hold empty, '.' or '..' segments")
    if len(prefix.encode()) > MAX_PREFIX:
        raise ConfigError(f"{url!r}: the prefix is limited to {MAX_PREFIX} bytes")
    return Location(bucket, f"{prefix}/" if prefix else "")


def parse(url: str, options: Mapping[str, Any]) -> tuple[Location, S3Options]:
    location = parse_url(url)
    return location, parse_options(S3Options, url, options)
