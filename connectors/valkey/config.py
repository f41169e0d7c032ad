"""Options and URLs of the Valkey connector, turned into valkey-glide client configurations.

URLs::

    valkey://[user:password@]host[:port][/db]          one server
    valkeys://[user:password@]host[:port][/db]         one server over TLS
    valkey+cluster://[user:password@]host:port[,host:port...][/db]   a cluster (seed nodes)

Everything else is a keyword option, checked by ``ValkeyOptions`` (unknown options are errors).
A password may come from the URL or from the ``password`` option, not from both. Secrets are
``SecretStr`` and never appear in reprs or errors.

Timeouts: glide's own default request timeout is 250 ms, which a multi-MiB value cannot meet
on a busy machine; ``request_timeout`` (default 30 s) replaces it. Every request carries at most
one part (``part_size``) or one inline object (``inline_max``), so the default fits both with a
wide margin; the Store's tier timeout bounds a whole operation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeAlias
from urllib.parse import unquote

from glide import (
    AdvancedGlideClientConfiguration,
    AdvancedGlideClusterClientConfiguration,
    GlideClientConfiguration,
    GlideClusterClientConfiguration,
    NodeAddress,
    ServerCredentials,
    TlsAdvancedConfiguration,
)
from pydantic import Field, SecretStr, model_validator

from connectors._options import StrictOptions, split_url
from gateway.config import ByteSize, redact_url
from gateway.errors import ConfigError

MiB = 1 << 20
DEFAULT_PORT = 6379
MAX_VALUE = 512 * MiB
"""Valkey's default proto-max-bulk-len: no single value may be larger."""
MIN_PART_SIZE = 64 * 1024  # also what a stored manifest's parts must be at least

Scheme = Literal["valkey", "valkeys", "valkey+cluster"]
SCHEMES: tuple[str, ...] = ("valkey", "valkeys", "valkey+cluster")


class ValkeyOptions(StrictOptions):
    """Keyword options of ``valkey://``, ``valkeys://`` and ``valkey+cluster://``."""

    username: str | None = None
    password: SecretStr | None = None
    request_timeout: float = Field(default=30.0, gt=0, description="seconds per request")
    connect_timeout: float = Field(default=5.0, gt=0, description="seconds to (re)connect")
    ttl: float | None = Field(default=None, gt=0, description="server-side expiry, seconds")
    namespace: str = "kvgate:"
    # Defaults measured on 2 cores, 32 MiB objects (interleaved rounds, medians): 1 MiB parts
    # put ~1.1-1.4 GB/s against ~0.6-0.9 for 4 and 8 MiB parts, and get no slower; 16 part
    # requests in flight beat 32; 1, 2 and 4 clients were within noise of each other, with
    # 2 ahead for puts of several objects at once.
    part_size: ByteSize = Field(default=MiB, ge=MIN_PART_SIZE, lt=MAX_VALUE)
    # Objects up to 4 MiB go as one value: a framed 1 MiB tensor is 1 MiB + its header, and
    # splitting it into a 1 MiB part, a 64-byte part and a manifest made 1 MiB puts through a
    # Store 3x slower (0.29 against 0.80 GB/s, `kvgate bench --size 1MiB`).
    inline_max: ByteSize | None = Field(
        default=None, ge=0, lt=MAX_VALUE, description="bytes; None: 4 MiB"
    )
    concurrency: int = Field(default=16, ge=1, le=512, description="part requests in flight")
    connections: int = Field(default=2, ge=1, le=64, description="glide clients (connections)")
    tls: bool | None = Field(default=None, description="None: TLS for valkeys:// only")
    tls_ca_file: Path | None = None
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    tls_insecure: bool = Field(default=False, description="skip certificate checks (tests only)")

    @model_validator(mode="after")
    def _check_tls_pairs(self) -> ValkeyOptions:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if self.tls_insecure and self.tls_ca_file is not None:
            raise ValueError("tls_insecure skips the checks that tls_ca_file configures")
        return self

    @property
    def inline_limit(self) -> int:
        return 4 * MiB if self.inline_max is None else self.inline_max


@dataclass(frozen=True)
class Endpoint:
    """Where and as whom to connect, from the URL (and the credential options)."""

    scheme: str
    addresses: tuple[tuple[str, int], ...]
    cluster: bool
    tls: bool
    database: int | None
    username: str | None
    password: SecretStr | None

    @property
    def display(self) -> str:
        """The endpoint for messages: no credentials."""
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.addresses)
        db = "" if self.database is None else f"/{self.database}"
        return f"{self.scheme}://{hosts}{db}"


def _parse_host(text: str, url: str) -> tuple[str, int]:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port``."""
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise ConfigError(f"{redact_url(url)!r}: malformed IPv6 address {text!r}")
        port_text = rest[1:]
    else:
        host, _, port_text = text.partition(":")
    if not host:
        raise ConfigError(f"{redact_url(url)!r}: a host is missing")
    if not port_text:
        return host, DEFAULT_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(f"{redact_url(url)!r}: bad port {port_text!r}")
    return host, int(port_text)


def parse_endpoint(url: str, options: ValkeyOptions) -> Endpoint:
    """The endpoint named by ``url``; credentials from the URL or the options, not both."""
    scheme = url.partition("://")[0].lower()
    if scheme not in SCHEMES:
        raise ConfigError(
            f"{redact_url(url)!r} is not a valkey://, valkeys:// or valkey+cluster:// URL"
        )
    try:
        parts = split_url(url, scheme)
    except ValueError as exc:  # urlsplit: malformed IPv6 brackets
        raise ConfigError(f"{redact_url(url)!r}: {exc}") from None
    userinfo, at, hostlist = parts.netloc.rpartition("@")
    addresses = tuple(_parse_host(h, url) for h in hostlist.split(",")) if hostlist else ()
    if not addresses:
        raise ConfigError(f"{redact_url(url)!r}: no host given")
    cluster = scheme == "valkey+cluster"
    if len(addresses) > 1 and not cluster:
        raise ConfigError(f"{redact_url(url)!r}: several hosts need valkey+cluster://")
    path = parts.path.strip("/")
    if path and not path.isdigit():
        raise ConfigError(f"{redact_url(url)!r}: the path must be a database number, e.g. /0")
    url_user, colon, url_password = userinfo.partition(":")
    if at and not colon:  # "user@host" or "password@host"? Redis URLs read it as a user
        url_password = ""
    username = unquote(url_user) or None
    password = SecretStr(unquote(url_password)) if url_password else None
    if password is not None and options.password is not None:
        raise ConfigError(f"{redact_url(url)!r}: password given in both the URL and options")
    if username is not None and options.username is not None:
        raise ConfigError(f"{redact_url(url)!r}: username given in both the URL and options")
    tls = scheme == "valkeys" if options.tls is None else options.tls
    if scheme == "valkeys" and not tls:
        raise ConfigError(f"{redact_url(url)!r}: valkeys:// always uses TLS")
    return Endpoint(
        scheme=scheme,
        addresses=addresses,
        cluster=cluster,
        tls=tls,
        database=int(path) if path else None,
        username=username or options.username,
        password=password or options.password,
    )


def _tls_config(endpoint: Endpoint, options: ValkeyOptions) -> TlsAdvancedConfiguration | None:
    if not endpoint.tls:
        if options.tls_ca_file or options.tls_cert_file or options.tls_insecure:
            raise ConfigError(f"{endpoint.display}: TLS options without TLS (use valkeys://)")
        return None
    try:
        ca = options.tls_ca_file.read_bytes() if options.tls_ca_file else None
    except OSError as exc:
        raise ConfigError(f"{endpoint.display}: cannot read tls_ca_file: {exc}") from None
    if ca is None and options.tls_cert_file is None and not options.tls_insecure:
        return None  # the system's trust store
    return TlsAdvancedConfiguration(
        use_insecure_tls=options.tls_insecure or None,
        root_pem_cacerts=ca,
        client_cert_path=options.tls_cert_file,
        client_key_path=options.tls_key_file,
    )


GlideConfig: TypeAlias = GlideClientConfiguration | GlideClusterClientConfiguration


def glide_config(
    endpoint: Endpoint, options: ValkeyOptions, *, request_timeout: float | None = None
) -> GlideConfig:
    """The glide configuration of one client for ``endpoint``."""
    credentials = None
    if endpoint.password is not None or endpoint.username is not None:
        password = endpoint.password.get_secret_value() if endpoint.password else None
        credentials = ServerCredentials(password=password, username=endpoint.username)
    tls = _tls_config(endpoint, options)
    connect_ms = max(1, round(options.connect_timeout * 1000))
    request_ms = max(1, round((request_timeout or options.request_timeout) * 1000))
    addresses = [NodeAddress(host, port) for host, port in endpoint.addresses]
    # The cluster and standalone configurations take the same arguments.
    config_class, advanced_class = (
        (GlideClusterClientConfiguration, AdvancedGlideClusterClientConfiguration)
        if endpoint.cluster
        else (GlideClientConfiguration, AdvancedGlideClientConfiguration)
    )
    config: GlideConfig = config_class(
        addresses,
        use_tls=endpoint.tls,
        credentials=credentials,
        request_timeout=request_ms,
        database_id=endpoint.database,
        client_name="kvgate",
        advanced_config=advanced_class(connection_timeout=connect_ms, tls_config=tls),
    )
    return config
