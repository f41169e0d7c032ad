"""The redis-py client of one connector, per mode, and the one map of its errors.

``RedisClient`` builds redis-py's asyncio client for the target (``Redis`` for one server over
TCP, TLS or a unix socket; ``Redis`` on a ``SentinelConnectionPool`` for Sentinel;
``RedisCluster`` for a cluster) with hiredis parsing, redis-py's own retries switched off (the
Store's retry layer decides), every socket operation under ``socket_timeout`` and connecting
under ``socket_connect_timeout``.

Every command goes through ``RedisClient.run``: it holds one of ``max_connections`` permits for
the command's duration, so redis-py's pools never need more connections than that (per node on
a cluster), and it turns every exception into a ``GatewayError`` kind with ``redis_error``, the
single place where redis-py's exceptions are mapped:

- connection refused/reset, LOADING, CLUSTERDOWN, TRYAGAIN, MASTERDOWN, READONLY and UNBLOCKED
  (a master demoted by a failover), no master known to the sentinels -> ``Unavailable``
  (retryable);
- socket timeouts -> ``Timeout``;
- AUTH failures (NOAUTH, WRONGPASS, ...), ACL refusals, a server certificate that does not
  verify -> ``ConfigError``, with every password scrubbed from the message;
- OOM (``maxmemory`` reached under ``noeviction``) -> ``CapacityError``;
- WRONGTYPE (a key of ours holding something we never write) -> ``ForeignObject`` (a miss,
  left in place);
- any other server error -> ``GatewayError`` with the server's message.

``endpoint_for(key)`` tells the fast path (``fastpath``) where a command on ``key`` goes: the
server, the master the sentinels named (asked again after a fast-path connection to it failed,
which also moves redis-py's pool), or the cluster node owning the key's slot in redis-py's slot
map (reloaded after a failure).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.connection import RedisSSLContext
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.exceptions import (
    AskError,
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    AuthorizationError,
    ClusterDownError,
    NoPermissionError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from connectors.redis.config import RedisOptions, Target
from gateway.config import REDACTED
from gateway.errors import (
    CapacityError,
    ConfigError,
    ForeignObject,
    GatewayError,
    Timeout,
    Unavailable,
)

T = TypeVar("T")
CLIENT_NAME = "kvgate"
_UNAVAILABLE = (
    RedisConnectionError,
    ClusterDownError,  # MASTERDOWN too
    TryAgainError,
    ReadOnlyError,  # a write reached a master that was demoted by a failover
    AskError,  # MOVED too: redirections beyond redis-py's own budget (slots moving)
    OSError,
)
_AUTH = (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    AuthorizationError,
    NoPermissionError,
)
_AUTH_CODES = ("NOAUTH", "WRONGPASS", "NOPERM")


def redis_error(exc: BaseException, where: str, secrets: Sequence[str] = ()) -> GatewayError:
    """The ``GatewayError`` kind for ``exc`` raised at ``where`` (a redacted URL and an op)."""
    if isinstance(exc, GatewayError):
        return exc
    text = str(exc) or type(exc).__name__
    for secret in secrets:
        if secret:
            text = text.replace(secret, REDACTED)
    message = f"{where}: {text}"
    # The error code: redis-py keeps it aside for the codes it knows; otherwise it leads the
    # server's message, which a pipeline wraps as "Command # n (...) caused error: ('CODE ...',)".
    detail = text.rpartition("caused error: ")[2].lstrip("('\"")
    code = getattr(exc, "status_code", None) or detail.partition(" ")[0]
    # Logged in, but the user's ACL refuses the command or the key.
    if isinstance(exc, NoPermissionError) or code == "NOPERM" or "no permissions" in text:
        return ConfigError(f"{message} (the user's ACL refuses this: grant it on the server)")
    # "unauthenticated bulk length": a large command sent before AUTH (no password given).
    if isinstance(exc, _AUTH) or code in _AUTH_CODES or "unauthenticated" in text:
        return ConfigError(f"{message} (authentication failed: check username and password)")
    if isinstance(exc, ssl.SSLCertVerificationError) or "certificate verify failed" in text:
        return ConfigError(f"{message} (the server's TLS certificate does not verify)")
    if isinstance(exc, OutOfMemoryError) or code == "OOM":
        return CapacityError(f"{message} (the server is full: maxmemory reached)")
    if isinstance(exc, RedisTimeoutError | TimeoutError):
        return Timeout(message)
    # UNBLOCKED: a WAIT cut short because its master was turned into a replica (failover).
    if isinstance(exc, _UNAVAILABLE) or code in ("LOADING", "MASTERDOWN", "UNBLOCKED"):
        return Unavailable(message)
    if isinstance(exc, RedisClusterException) and (
        "cannot be connected" in text or "not covered" in text
    ):
        return Unavailable(message)
    if isinstance(exc, ResponseError) and code == "WRONGTYPE":
        return ForeignObject(f"{message} (a key of ours holds a value of another type)")
    return GatewayError(message)


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One server the fast reader connects to: a TCP address or a unix socket path."""

    host: str = ""
    port: int = 0
    path: str | None = None

    def __str__(self) -> str:
        return self.path if self.path is not None else f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class Login:
    """What a new connection to a data node sends before its first command."""

    username: str | None
    password: str | None = field(repr=False)
    db: int


class RedisClient:
    """redis-py's client for ``target``, bounded and with its errors mapped (module docs)."""

    def __init__(self, target: Target, options: RedisOptions) -> None:
        self.target = target
        self.options = options
        sentinel_password = options.sentinel_password
        self.secrets = tuple(
            s
            for s in (
                target.password,
                sentinel_password.get_secret_value() if sentinel_password else None,
            )
            if s
        )
        self.login = Login(target.username, target.password, target.db)
        self.ssl_context = self._ssl_context() if target.tls else None
        self._permits = asyncio.Semaphore(options.max_connections)
        self._master: Endpoint | None = None  # the sentinels' master, as last asked
        self._discovering = asyncio.Lock()
        self.sentinel: Sentinel | None = None
        self.cluster: RedisCluster | None = None
        self.single: Redis | None = None
        try:
            self._build()
        except RedisError as exc:  # bad TLS file names and the like
            raise ConfigError(f"{target.redacted}: {exc}") from None

    @property
    def redis(self) -> Redis | RedisCluster:
        """The redis-py client that commands go to."""
        client = self.cluster if self.cluster is not None else self.single
        assert client is not None
        return client

    def _common(self) -> dict[str, Any]:
        opts = self.options
        return {
            "socket_timeout": opts.socket_timeout,
            "socket_connect_timeout": opts.socket_connect_timeout,
            "health_check_interval": opts.health_check_interval,
            "retry": Retry(NoBackoff(), 0),  # the Store's retry layer retries, not redis-py
            "client_name": CLIENT_NAME,
            "username": self.target.username,
            "password": self.target.password,
        }

    def _tls(self) -> dict[str, Any]:
        if not self.target.tls:
            return {}
        opts = self.options
        return {
            "ssl": True,
            "ssl_ca_certs": opts.ssl_ca_certs,
            "ssl_certfile": opts.ssl_certfile,
            "ssl_keyfile": opts.ssl_keyfile,
            "ssl_cert_reqs": opts.ssl_cert_reqs,
            "ssl_check_hostname": opts.check_hostname,
        }

    def _ssl_context(self) -> ssl.SSLContext:
        """The TLS context of the fast reader, built as redis-py builds its own."""
        opts = self.options
        try:
            return RedisSSLContext(
                keyfile=opts.ssl_keyfile,
                certfile=opts.ssl_certfile,
                cert_reqs=opts.ssl_cert_reqs,
                ca_certs=opts.ssl_ca_certs,
                check_hostname=opts.check_hostname,
            ).get()
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"{self.target.redacted}: TLS files: {exc}") from None

    def _build(self) -> None:
        target, opts = self.target, self.options
        common = self._common()
        if target.mode == "cluster":
            self.cluster = RedisCluster(
                startup_nodes=[ClusterNode(host, port) for host, port in target.hosts],
                max_connections=opts.max_connections,
                **common,
                **self._tls(),
            )
        elif target.mode == "sentinel":
            assert target.service is not None
            sentinel_password = opts.sentinel_password
            self.sentinel = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]  # typed from redis 8.2
                list(target.hosts),
                sentinel_kwargs={
                    "socket_timeout": min(opts.socket_timeout, 5.0),
                    "socket_connect_timeout": opts.socket_connect_timeout,
                    "retry": Retry(NoBackoff(), 0),
                    "username": opts.sentinel_username,
                    "password": sentinel_password.get_secret_value() if sentinel_password else None,
                },
            )
            pool = SentinelConnectionPool(  # type: ignore[no-untyped-call]
                target.service,
                self.sentinel,
                is_master=True,
                db=target.db,
                max_connections=opts.max_connections,
                **common,
            )
            self.single = Redis.from_pool(pool)
        elif target.unix_path is not None:
            self.single = Redis(
                unix_socket_path=target.unix_path,
                db=target.db,
                max_connections=opts.max_connections,
                **common,
            )
        else:
            (host, port), *_ = target.hosts
            self.single = Redis(
                host=host,
                port=port,
                db=target.db,
                max_connections=opts.max_connections,
                **common,
                **self._tls(),
            )

    def error(self, exc: BaseException, what: str) -> GatewayError:
        return redis_error(exc, f"{self.target.redacted} {what}", self.secrets)

    async def run(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """``await call()`` holding a connection permit; its failure as a GatewayError."""
        async with self._permits:
            try:
                if self.cluster is not None:
                    # Learn (or re-learn, after a failure) the slot map before the command,
                    # under redis-py's lock: a refresh inside concurrent commands closes
                    # connections that others are still opening.
                    await self.cluster.initialize()
                return await call()
            except Exception as exc:
                raise self.error(exc, what) from exc

    async def endpoint_for(self, key: bytes) -> Endpoint:
        """The server that redis-py would send a command on ``key`` to (see module docs)."""
        target = self.target
        if self.cluster is not None:
            try:
                await self.cluster.initialize()  # a no-op unless the slot map must be (re)read
                node = self.cluster.get_node_from_key(key)  # type: ignore[arg-type]  # bytes hash as-is
            except Exception as exc:
                raise self.error(exc, "cluster slots") from exc
            assert node is not None
            return Endpoint(node.host, int(node.port))
        if self.sentinel is not None and self.single is not None:
            if self._master is not None:
                return self._master
            async with self._discovering:  # one question to the sentinels at a time
                if self._master is None:
                    pool = self.single.connection_pool
                    assert isinstance(pool, SentinelConnectionPool)
                    # Asks the sentinels; moves redis-py's pool too if the master changed.
                    host, port = await self.run("discover master", pool.get_master_address)
                    self._master = Endpoint(str(host), int(port))
                return self._master
        if target.unix_path is not None:
            return Endpoint(path=target.unix_path)
        (host, port), *_ = target.hosts
        return Endpoint(host, port)

    def suspect(self, endpoint: Endpoint) -> None:
        """A fast-path connection to ``endpoint`` failed: the topology may have changed."""
        if self._master == endpoint:
            self._master = None  # the next endpoint_for asks the sentinels again
        if self.cluster is not None:
            # redis-py's own signal to reload the slot map before its next command (it sets
            # it itself when one of its connections fails).
            self.cluster._initialize = True

    def server_hostname(self, endpoint: Endpoint) -> str | None:
        """The name a TLS connection to ``endpoint`` checks the certificate against."""
        if self.ssl_context is None or endpoint.path is not None:
            return None
        return endpoint.host

    async def close(self) -> None:
        if self.cluster is not None:
            await self.cluster.aclose()
        if self.single is not None:
            await self.single.aclose()
        if self.sentinel is not None:
            await self.sentinel.aclose()
