"""``scheme://bucket/prefix``: the URLs of the S3 tiers (``s3://`` and ``obstore+s3://``).

The URL names only the bucket and a key prefix; endpoint, credentials, sizes and timeouts are
typed options, so that one strict model validates them and no secret sits in a URL.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote

from connectors._options import split_url
from gateway.config import redact_url
from gateway.errors import ConfigError

MAX_PREFIX = 512
"""Bytes of URL prefix: the rest of S3's 1024-byte names is left for the keys."""

# Bucket names as S3 allows them (3-63 chars of lowercase letters, digits, dots and hyphens),
# plus the underscores and capitals that some S3-compatible servers still accept.
_BUCKET_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{1,254}$")


@dataclass(frozen=True, slots=True)
class Location:
    """Where objects live: a bucket and the prefix every object name starts with."""

    bucket: str
    prefix: str
    """"" or a path ending in "/"."""


def parse_bucket_url(url: str, scheme: str) -> Location:
    parts = split_url(url, scheme)
    if parts.username is not None or parts.password is not None:
        raise ConfigError(
            f"{redact_url(url)!r}: credentials go in the access_key_id / secret_access_key "
            "options (or the AWS environment), not in the URL"
        )
    bucket = parts.netloc
    if not _BUCKET_RE.match(bucket):
        raise ConfigError(f"{url!r}: expected {scheme}://bucket/prefix with a valid bucket name")
    prefix = unquote(parts.path).strip("/")
    if "//" in prefix or any(p in (".", "..") for p in prefix.split("/") if prefix):
        raise ConfigError(f"{url!r}: the prefix must not hold empty, '.' or '..' segments")
    if len(prefix.encode()) > MAX_PREFIX:
        raise ConfigError(f"{url!r}: the prefix is limited to {MAX_PREFIX} bytes")
    return Location(bucket, f"{prefix}/" if prefix else "")
