"""What the two S3 tiers (``s3://`` on aioboto3, ``obstore+s3://`` on obstore) share: the
``scheme://bucket/prefix`` URL and the options that say where the server is and who we are.

The URL names only the bucket and a key prefix; endpoint, credentials, sizes and timeouts are
typed options, so that one strict model validates them and no secret sits in a URL. Each tier's
options model extends ``S3AccessOptions`` with its client's own settings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import unquote

from pydantic import Field, SecretStr, field_validator, model_validator

from connectors._options import StrictOptions, split_url
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


class S3AccessOptions(StrictOptions):
    """Where the S3 server is and the credentials to use (both S3 tiers)."""

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
    connect_timeout: float = Field(default=5.0, ge=0.001, le=3600)

    @field_validator("endpoint_url")
    @classmethod
    def _check_endpoint(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^https?://[^/?#]+/?$", value):
            raise ValueError("expected http(s)://host[:port] with no path or query")
        return value

    @model_validator(mode="after")
    def _check_credentials(self) -> S3AccessOptions:
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ValueError("give access_key_id and secret_access_key together (or neither)")
        if self.session_token is not None and self.access_key_id is None:
            raise ValueError("session_token needs access_key_id and secret_access_key")
        return self

    def __repr_args__(self) -> Any:
        # SecretStr already hides the secrets; the key id is hidden too (config.py's rule).
        for name, value in super().__repr_args__():
            yield name, ("***" if name == "access_key_id" and value else value)
