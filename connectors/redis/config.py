"""URL and options of the Redis connectors: what to connect to, how, and how to store objects.

URL forms (options never go in the query string; they are keyword arguments):

- ``redis://[[user]:password@]host[:port][/db]`` — one server over TCP (port 6379, db 0).
- ``rediss://...`` — the same over TLS; options ``ssl_ca_certs``, ``ssl_certfile``,
  ``ssl_keyfile``, ``ssl_cert_reqs`` (required | optional | none) and ``check_hostname``.
- ``unix:///path/to/redis.sock`` — one server on a unix socket; the database is option ``db``.
- ``redis+sentinel://[[user]:password@]host1[:port1][,host2[:port2]...]/service_name[/db]`` —
  the master of ``service_name`` as the sentinels report it (sentinel port 26379). Credentials
  in the URL (or options ``username``/``password``) are the data nodes'; the sentinels' own are
  options ``sentinel_username``/``sentinel_password``.
- ``redis+cluster://[[user]:password@]host[:port][,host[:port]...]`` — a Redis Cluster found
  through these startup nodes (db 0 only).

A user part without a colon (``redis://secret@host``) is a password, as for ``AUTH secret``.
Credentials may come from the URL or from the options, not both. The URL is only ever shown
redacted (``gateway.config.redact_url``) and the options' secrets are ``SecretStr``.

Options (``RedisOptions``; unknown ones are errors, so are ``capacity``/``eviction``: Redis
evicts by its own ``maxmemory-policy``):

- ``username``/``password``; ``sentinel_username``/``sentinel_password``; ``db`` (unix://);
- ``socket_timeout`` (30 s: one command, sized for large values), ``socket_connect_timeout``
  (2 s), ``health_check_interval`` (0: off);
- ``max_connections`` (32): redis-py commands in flight at once, and fast-path connections
  per node; ``stripe_concurrency`` (8): parts of one object in flight;
- ``part_size`` (4 MiB) and ``inline_max`` (default: ``part_size``): objects up to
  ``inline_max`` are one value, larger ones are parts;
- ``ttl`` (None): server-side expiry of every object, seconds;
- ``namespace`` ("kvgate:"): prefix of every key this connector writes;
- ``min_replicas_ack`` (0) and ``replicas_ack_timeout`` (1 s): ``WAIT`` for that many replicas
  after each put, so that an acknowledged put survives a failover (not on a cluster);
- ``fast_path`` (True): move values over the connector's own zero-copy connections;
- TLS (rediss:// only): ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs``,
  ``check_hostname``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import unquote

from pydantic import Field, SecretStr, model_validator

from connectors._options import StrictOptions, split_url
from gateway.config import redact_url
from gateway.errors import ConfigError

MiB = 1 << 20
MIN_PART_SIZE = 1024  # also what a stored manifest's parts must be at least (gateway.parts)
SCHEMES = ("redis", "rediss", "unix", "redis+sentinel", "redis+cluster")
Mode = Literal["standalone", "sentinel", "cluster"]
DEFAULT_PORT = 6379
DEFAULT_SENTINEL_PORT = 26379


class RedisOptions(StrictOptions):
    """Options of every Redis scheme (each is checked against the scheme by ``resolve``)."""

    username: str | None = None
    password: SecretStr | None = None
    sentinel_username: str | None = None
    sentinel_password: SecretStr | None = None
    db: int | None = Field(default=None, ge=0, description="unix:// database (else in the URL)")
    # A 256 MiB value must fit in one socket read deadline; a dead host must not take long.
    socket_timeout: float = Field(default=30.0, gt=0, description="seconds per command")
    socket_connect_timeout: float = Field(default=2.0, gt=0)
    health_check_interval: int = Field(default=0, ge=0, description="seconds; 0 = off")
    max_connections: int = Field(default=32, ge=1, description="commands in flight at once")
    stripe_concurrency: int = Field(default=8, ge=1, description="parts in flight per object")
    part_size: int = Field(default=4 * MiB, ge=MIN_PART_SIZE, le=512 * MiB)
    inline_max: int | None = Field(default=None, ge=0, description="default: part_size")
    ttl: float | None = Field(default=None, gt=0, description="server-side expiry, seconds")
    namespace: str = "kvgate:"
    min_replicas_ack: int = Field(default=0, ge=0, description="WAIT for this many replicas")
    replicas_ack_timeout: float = Field(default=1.0, gt=0, description="seconds of WAIT")
    fast_path: bool = Field(default=True, description="parts and commits without copies")
    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_cert_reqs: Literal["required", "optional", "none"] = "required"
    check_hostname: bool = True

    @model_validator(mode="after")
    def _check(self) -> RedisOptions:
        if self.inline_max is not None and self.inline_max > 512 * MiB - 1:
            raise ValueError("inline_max must stay below Redis's 512 MiB value limit")
        if self.ssl_keyfile and not self.ssl_certfile:
            raise ValueError("ssl_keyfile needs ssl_certfile")
        return self

    @property
    def effective_inline_max(self) -> int:
        return self.part_size if self.inline_max is None else self.inline_max


@dataclass(frozen=True, slots=True)
class Target:
    """Where a URL points: the mode, its addresses and the data nodes' credentials."""

    scheme: str
    mode: Mode
    hosts: tuple[tuple[str, int], ...]  # the server, the sentinels or the startup nodes
    unix_path: str | None
    db: int
    service: str | None  # sentinel service name
    tls: bool
    username: str | None
    password: str | None = field(repr=False)
    redacted: str = ""  # the URL as it may be shown


_SSL_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")


def resolve(url: str, options: RedisOptions) -> Target:
    """``url`` checked and split into a ``Target``; options that contradict it are errors."""
    scheme = url.partition("://")[0].lower()
    if scheme not in SCHEMES:
        raise ConfigError(f"{redact_url(url)!r} is not one of {', '.join(SCHEMES)}")
    parts = split_url(url, scheme)
    shown = redact_url(url)
    userinfo, at, hostpart = parts.netloc.rpartition("@")
    username, password = _credentials(userinfo) if at else (None, None)
    if password is not None and options.password is not None:
        raise ConfigError(f"{shown}: a password in the URL and in the options; give one")
    if username is not None and options.username is not None:
        raise ConfigError(f"{shown}: a user name in the URL and in the options; give one")
    username = username if username is not None else options.username
    if password is None and options.password is not None:
        password = options.password.get_secret_value()
    tls = scheme == "rediss"
    if not tls and any(getattr(options, name) for name in _SSL_OPTIONS):
        raise ConfigError(f"{shown}: ssl_* options need a rediss:// URL")
    if scheme != "redis+sentinel" and (options.sentinel_password or options.sentinel_username):
        raise ConfigError(f"{shown}: sentinel_* options need a redis+sentinel:// URL")
    path = unquote(parts.path)
    db_in_url: int | None = None
    service: str | None = None
    unix_path: str | None = None
    hosts: tuple[tuple[str, int], ...] = ()
    if scheme == "unix":
        if hostpart not in ("", "localhost") or not path.startswith("/"):
            raise ConfigError(f"{shown}: expected unix:///absolute/path/to/redis.sock")
        unix_path = path
        mode: Mode = "standalone"
    elif scheme == "redis+sentinel":
        hosts = _hosts(hostpart, DEFAULT_SENTINEL_PORT, shown)
        segments = [s for s in path.split("/") if s]
        if not 1 <= len(segments) <= 2:
            raise ConfigError(
                f"{shown}: expected redis+sentinel://host:port[,host:port]/service_name[/db]"
            )
        service = segments[0]
        db_in_url = _db(segments[1], shown) if len(segments) == 2 else None
        mode = "sentinel"
    else:
        hosts = _hosts(hostpart, DEFAULT_PORT, shown)
        segments = [s for s in path.split("/") if s]
        if len(segments) > 1:
            raise ConfigError(f"{shown}: the URL path is the database number only")
        db_in_url = _db(segments[0], shown) if segments else None
        if scheme == "redis+cluster":
            mode = "cluster"
        else:
            mode = "standalone"
            if len(hosts) != 1:
                raise ConfigError(f"{shown}: {scheme}:// takes one host; use redis+cluster://")
    if db_in_url is not None and options.db is not None:
        raise ConfigError(f"{shown}: the database in the URL and in option db; give one")
    db = db_in_url if db_in_url is not None else (options.db or 0)
    if mode == "cluster" and db != 0:
        raise ConfigError(f"{shown}: Redis Cluster has database 0 only")
    if options.min_replicas_ack and not options.fast_path:
        # WAIT must follow an inline commit on its own connection: the fast path's.
        raise ConfigError(f"{shown}: min_replicas_ack needs fast_path")
    if mode == "cluster" and options.min_replicas_ack:
        raise ConfigError(f"{shown}: min_replicas_ack is not supported on redis+cluster://")
    return Target(
        scheme=scheme,
        mode=mode,
        hosts=hosts,
        unix_path=unix_path,
        db=db,
        service=service,
        tls=tls,
        username=username,
        password=password,
        redacted=shown,
    )


def _credentials(userinfo: str) -> tuple[str | None, str | None]:
    user, colon, password = userinfo.partition(":")
    if not colon:  # redis://secret@host: a bare password, as AUTH takes it
        return None, unquote(user) or None
    return unquote(user) or None, unquote(password) or None


def _hosts(hostpart: str, default_port: int, shown: str) -> tuple[tuple[str, int], ...]:
    out = []
    for item in hostpart.split(","):
        item = item.strip()
        if item.startswith("["):  # [::1]:6379
            host, _, rest = item[1:].partition("]")
            port_text = rest[1:] if rest.startswith(":") else ""
            if rest and not rest.startswith(":"):
                raise ConfigError(f"{shown}: bad address {item!r}")
        else:
            host, _, port_text = item.partition(":")
        if not host:
            raise ConfigError(f"{shown}: an address without a host name")
        try:
            port = int(port_text) if port_text else default_port
        except ValueError:
            raise ConfigError(f"{shown}: bad port in {item!r}") from None
        if not 0 < port < 65536:
            raise ConfigError(f"{shown}: port {port} out of range")
        out.append((host, port))
    return tuple(out)


def _db(text: str, shown: str) -> int:
    if not text.isdigit():
        raise ConfigError(f"{shown}: the database must be a number, got {text!r}")
    return int(text)
