"""Options of ``gs://bucket/prefix`` and the parsing of its URL.

Credentials are gcloud-aio-auth's: the ``service_file`` option (a service account's JSON file),
else ``GOOGLE_APPLICATION_CREDENTIALS``, else the metadata server of the VM. An ``endpoint``
names an emulator (or ``STORAGE_EMULATOR_HOST`` does), which is spoken to without credentials.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import Field, field_validator

from connectors._options import StrictOptions, parse_options, split_url
from gateway.config import ByteSize, redact_url
from gateway.errors import ConfigError

MiB = 1 << 20
MAX_COMPONENTS = 32
"""GCS composes at most 32 objects in one request."""
MAX_PREFIX = 512
DEFAULT_API_ROOT = "https://storage.googleapis.com"
ENV_EMULATOR = "STORAGE_EMULATOR_HOST"

# GCS bucket names: 3-63 characters (222 with dots) of lowercase letters, digits, - _ and .
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")


class GcsOptions(StrictOptions):
    endpoint: str | None = Field(
        default=None,
        description="http(s)://host:port of a GCS emulator (no credentials are sent); "
        "None = Google Cloud Storage, or STORAGE_EMULATOR_HOST when set",
    )
    service_file: str | None = Field(
        default=None, description="a service account's JSON key file (path)"
    )
    request_timeout: float = Field(
        default=120.0,
        gt=0,
        description="one whole HTTP request: a put under put_threshold, one part, the compose, "
        "one range",
    )
    # Objects up to 64 MiB (a 32 MiB chunk and its frame header, too) move in one request each
    # way: on a local server more streams per object only add overhead at that size.
    put_threshold: ByteSize = Field(
        default=64 * MiB, gt=0, description="larger objects go as parts composed at the end"
    )
    part_size: ByteSize = Field(default=8 * MiB, gt=0)
    ranged_get_threshold: ByteSize = Field(default=64 * MiB, gt=0)
    range_size: ByteSize = Field(default=8 * MiB, gt=0)
    max_concurrency: int = Field(
        default=8, ge=1, description="parts or ranges in flight, per object"
    )
    check_bucket: bool = Field(default=True, description="GET the bucket on first use")
    batch_concurrency: int = Field(default=16, ge=1)

    @field_validator("endpoint")
    @classmethod
    def _check_endpoint(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^https?://[^/?#]+/?$", value):
            raise ValueError("expected http(s)://host[:port] with no path or query")
        return value.rstrip("/") if value is not None else None


@dataclass(frozen=True, slots=True)
class Location:
    bucket: str
    prefix: str
    """"" or a path ending in "/"."""


def parse_url(url: str) -> Location:
    parts = split_url(url, "gs")
    if parts.username is not None or parts.password is not None:
        raise ConfigError(f"{redact_url(url)!r}: credentials go in service_file, not the URL")
    bucket = parts.netloc
    if not _BUCKET_RE.match(bucket):
        raise ConfigError(f"{url!r}: expected gs://bucket/prefix with a valid bucket name")
    prefix = parts.path.strip("/")
    if "//" in prefix or any(p in (".", "..") for p in prefix.split("/") if prefix):
        raise ConfigError(f"{url!r}: the prefix must not hold empty, '.' or '..' segments")
    if len(prefix.encode()) > MAX_PREFIX:
        raise ConfigError(f"{url!r}: the prefix is limited to {MAX_PREFIX} bytes")
    return Location(bucket, f"{prefix}/" if prefix else "")


def parse(url: str, options: Mapping[str, Any]) -> tuple[Location, GcsOptions]:
    return parse_url(url), parse_options(GcsOptions, url, options)


def api_root(opts: GcsOptions) -> tuple[str, bool]:
    """(the API's root URL, whether it is an emulator that takes no credentials)."""
    if opts.endpoint is not None:
        return opts.endpoint, True
    emulator = os.environ.get(ENV_EMULATOR)
    if emulator:
        root = emulator if "://" in emulator else f"http://{emulator}"
        return root.rstrip("/"), True
    return DEFAULT_API_ROOT, False
