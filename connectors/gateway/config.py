"""Options of ``gateway://`` / ``gateways://`` and the parsing of their URL.

The URL names the remote service (``gateway://host:port``, HTTPS with ``gateways://``); the
bearer token, TLS settings, timeouts and pool size are typed options, so one strict model
validates them and the token never sits in a URL that could be logged.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import Field, SecretStr

from connectors._options import StrictOptions, parse_options, split_url
from gateway.config import redact_url
from gateway.errors import ConfigError

DEFAULT_PORT = 8080
SCHEMES = {"gateway": "http", "gateways": "https"}


class GatewayOptions(StrictOptions):
    token: SecretStr | None = Field(
        default=None, description="bearer token of the remote gateway (never logged)"
    )
    timeout: float = Field(default=30.0, gt=0, description="one whole request, in seconds")
    connect_timeout: float = Field(default=5.0, gt=0)
    max_connections: int = Field(default=32, ge=1, description="HTTP/1.1 keep-alive pool size")
    verify_tls: bool = Field(default=True, description="gateways:// only; False for tests")
    ca_bundle: str | None = Field(default=None, description="PEM file of CAs to trust")
    codec: str = Field(
        default="raw", description="codec the remote encodes GET answers with (wire codec)"
    )
    codec_options: dict[str, Any] = Field(default_factory=dict)
    batch_concurrency: int = Field(default=16, ge=1)


@dataclass(frozen=True, slots=True)
class Endpoint:
    """The remote service: its base URL (``http(s)://host:port``, no path) and scheme."""

    scheme: str
    base_url: str

    @property
    def tls(self) -> bool:
        return self.scheme == "gateways"


def parse_url(url: str) -> Endpoint:
    scheme = url.partition("://")[0].lower()
    if scheme not in SCHEMES:
        raise ConfigError(f"{redact_url(url)!r} is not a gateway:// or gateways:// URL")
    parts = split_url(url, scheme)
    if parts.username is not None or parts.password is not None:
        raise ConfigError(
            f"{redact_url(url)!r}: the token goes in the 'token' option (or KVGATE_TOKEN for "
            "the CLI), not in the URL"
        )
    if parts.path not in ("", "/"):
        raise ConfigError(f"{url!r}: expected {scheme}://host[:port] with no path")
    if not parts.hostname:
        raise ConfigError(f"{url!r}: expected {scheme}://host[:port]")
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError:
        raise ConfigError(f"{url!r}: bad port") from None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return Endpoint(scheme, f"{SCHEMES[scheme]}://{host}:{port}")


def parse(url: str, options: Mapping[str, Any]) -> tuple[Endpoint, GatewayOptions]:
    endpoint = parse_url(url)
    opts = parse_options(GatewayOptions, url, options)
    if not endpoint.tls and (opts.ca_bundle is not None or not opts.verify_tls):
        raise ConfigError(f"{url!r}: ca_bundle and verify_tls apply to gateways:// only")
    return endpoint, opts


def tls_verify(opts: GatewayOptions) -> ssl.SSLContext | bool:
    """What httpx's ``verify`` gets: a context trusting ``ca_bundle``, or the flag."""
    if not opts.verify_tls:
        return False
    if opts.ca_bundle is None:
        return True
    try:
        return ssl.create_default_context(cafile=opts.ca_bundle)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"ca_bundle {opts.ca_bundle!r}: {exc}") from None
