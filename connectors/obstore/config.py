"""Options of ``obstore+s3://bucket/prefix``, turned into obstore's ``S3Store`` arguments.

The URL names the bucket and a key prefix (``connectors/s3_access.py``, the same rules as
``s3://``); everything else is a typed option. Credentials and the region, when not given
here, come from obstore's own reading of the environment (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``, …), as an S3 client's
operators expect; the endpoint comes from ``endpoint_url`` only. Secrets are ``SecretStr``:
never in a repr, a log line or an error.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import Field

from connectors._options import parse_options
from connectors.s3_access import Location, S3AccessOptions, parse_bucket_url
from gateway.config import ByteSize
from gateway.errors import ConfigError

SCHEME = "obstore+s3"
MiB = 1 << 20
MIN_PART_SIZE = 5 * MiB
"""S3 rejects multipart parts smaller than this (all but the last part)."""
CONTENT_TYPE = "application/octet-stream"


class ObstoreS3Options(S3AccessOptions):
    request_timeout: float = Field(
        default=120.0,
        ge=0.001,
        le=86400,
        description="one whole request (one object each way, or one multipart part)",
    )
    # One PutObject per object by default (S3 takes up to 5 GiB in one): a multipart upload
    # that a timeout or a dying process cuts short stays behind, invisible but billed, until
    # a lifecycle rule or s3://'s sweep aborts it, and obstore offers no way to list them.
    multipart_threshold: ByteSize | None = Field(
        default=None, gt=0, description="bytes above which a put is a multipart upload; None: never"
    )
    part_size: ByteSize = Field(default=8 * MiB, ge=MIN_PART_SIZE)
    max_concurrency: int = Field(default=8, ge=1, description="parts of one upload in flight")
    batch_concurrency: int = Field(default=16, ge=1, description="HEADs of one exists_many")
    max_attempts: int = Field(
        default=1, ge=1, le=10, description="obstore's own attempts; the tier has a retry layer"
    )
    check_bucket: bool = Field(
        default=True,
        description="list one object of the bucket on first use (fails fast on a wrong "
        "bucket or secret; needs s3:ListBucket)",
    )

    def store_arguments(self) -> dict[str, Any]:
        """Keyword arguments of ``obstore.store.S3Store`` (they hold the secret: never log)."""
        config: dict[str, Any] = {}
        if self.endpoint_url is not None:
            config["endpoint"] = self.endpoint_url.rstrip("/")
        if self.region is not None:
            config["region"] = self.region
        if self.access_key_id is not None and self.secret_access_key is not None:
            config["access_key_id"] = self.access_key_id
            config["secret_access_key"] = self.secret_access_key.get_secret_value()
        if self.session_token is not None:
            config["session_token"] = self.session_token.get_secret_value()
        style = self.addressing_style
        if style == "auto":
            style = "path" if self.endpoint_url is not None else "virtual"
        config["virtual_hosted_style_request"] = style == "virtual"
        client: dict[str, Any] = {
            "timeout": _duration(self.request_timeout),
            "connect_timeout": _duration(self.connect_timeout),
            "default_content_type": CONTENT_TYPE,
        }
        if self.endpoint_url is not None and self.endpoint_url.startswith("http://"):
            client["allow_http"] = True
        if not self.verify_tls:
            client["allow_invalid_certificates"] = True
        if self.ca_bundle is not None:
            try:
                client["root_certificate"] = Path(self.ca_bundle).read_text()
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(f"ca_bundle {self.ca_bundle!r}: {exc}") from None
        retry = {"max_retries": self.max_attempts - 1}
        return {"config": config, "client_options": client, "retry_config": retry}


def _duration(seconds: float) -> str:
    """Seconds as obstore's duration text (whole milliseconds: it parses no exponents)."""
    return f"{max(1, round(seconds * 1000))}ms"


def parse(url: str, options: Mapping[str, Any]) -> tuple[Location, ObstoreS3Options]:
    location = parse_bucket_url(url, SCHEME)
    return location, parse_options(ObstoreS3Options, url, options)
