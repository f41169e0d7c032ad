"""valkey-glide underneath the Valkey connector: a few clients, one error map, the part backend.

``GlidePool`` holds ``connections`` glide clients, created on first use, once a probe of
the server answers (``probe``: glide's create holds the event loop while it connects) and
spread round-robin over requests. Glide
multiplexes each client over one connection per node; several clients give several
connections, which large parallel part transfers use (see ``connections`` in the options).

``GlideParts`` is the ``PartBackend`` that ``gateway.parts.StripedObjects`` builds atomic
large objects on. At most ``concurrency`` part requests are in flight per connector; this also
bounds the memory of the copies glide makes: its public API turns every ``memoryview`` value
into ``bytes`` before sending (``bytes(view)``, one copy), and returns ``bytes`` for every GET,
which ``read_parts_into`` copies into the caller's buffer (glide cannot read into one, so the
connector is not zero-copy).

The commit (``swap``) and ``take`` are MULTI/EXEC transactions of GETRANGE (the first
``MANIFEST_SIZE`` bytes of the old value) and SET or DEL on the main key: atomic like
``SET ... GET`` and ``GETDEL``, without sending back a whole old inline object (up to
``inline_max`` bytes) when all ``StripedObjects`` needs from it is its head.

Every glide call runs inside ``glide_errors``, the one place where glide's exceptions become
kvgate's error kinds.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re
import sys
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

from glide import (
    Batch,
    CircuitBreakerError,
    ClosingError,
    ClusterBatch,
    ExecAbortError,
    ExpirySet,
    ExpiryType,
    GlideClient,
    GlideClusterClient,
    GlideClusterClientConfiguration,
    GlideError,
    RequestError,
)
from glide import ConfigurationError as GlideConfigurationError
from glide import ConnectionError as GlideConnectionError
from glide import Logger as GlideLogger
from glide import LogLevel as GlideLogLevel
from glide import TimeoutError as GlideTimeoutError

from connectors.valkey.config import Endpoint, GlideConfig, ValkeyOptions, glide_config
from connectors.valkey.probe import probe_tls, server_answers
from gateway.errors import (
    CapacityError,
    ConfigError,
    CorruptObject,
    GatewayError,
    Timeout,
    Unavailable,
)
from gateway.parts import MANIFEST_SIZE, bounded_all
from gateway.types import Buffer

T = TypeVar("T")
_DEL_KEYS = 1024
Client = GlideClient | GlideClusterClient


def _quiet_legacy_glide_modules() -> None:
    """Stop glide's legacy module proxies from warning when other code walks ``sys.modules``.

    Importing glide puts proxy modules (``glide.exceptions``, ...) into ``sys.modules`` that
    raise a DeprecationWarning on their first attribute access, even ``hasattr(m, "__file__")``
    from code that merely iterates ``sys.modules`` (``inspect.getmodule``, which torch calls
    when it registers custom ops). Under ``-W error`` that turns an unrelated import into an
    error. The proxies only warn once; marking them as having warned keeps them working.
    """
    for name, module in list(sys.modules.items()):
        if name.startswith("glide.") and type(module).__name__ == "_LegacyModule":
            module.__dict__["_warned"] = True


_quiet_legacy_glide_modules()


def _glide_logs_errors_only() -> None:
    """glide's core logs WARN lines of its own (two per failed reconnect) straight to the
    console, past kvgate's logging and its rate limits; kvgate reports those failures
    itself. Only where nobody set glide's logger up (``Logger.init`` keeps a set-up one)."""
    GlideLogger.init(GlideLogLevel.ERROR)


_AUTH_CODES = ("WRONGPASS", "NOAUTH", "INVALID USERNAME-PASSWORD")
_OOM = re.compile(r"\bOOM\b")
_BUSY_CODES = ("LOADING", "BUSY", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN", "READONLY")


def to_gateway_error(exc: GlideError, target: str) -> GatewayError:
    """The kvgate error kind for a glide exception (messages name the endpoint, no secret)."""
    text = str(exc).strip()
    upper = text.upper()
    if "NOPERM" in upper or "PERMISSIONDENIED" in upper or "NO PERMISSIONS" in upper:
        return ConfigError(
            f"{target}: the user's ACL refuses this (grant it on the server): {text}"
        )
    if any(code in upper for code in _AUTH_CODES):
        # The server's message names no password; the endpoint is shown without one.
        return ConfigError(f"{target}: authentication failed (check username/password): {text}")
    if isinstance(exc, GlideTimeoutError):
        return Timeout(f"{target}: request timed out (request_timeout): {text}")
    if _OOM.search(upper):
        return CapacityError(f"{target}: the server is out of memory (maxmemory): {text}")
    if "WRONGTYPE" in upper:
        return CorruptObject(f"{target}: a key holds something other than a string: {text}")
    if isinstance(exc, GlideConfigurationError):
        return ConfigError(f"{target}: {text}")
    if isinstance(exc, GlideConnectionError | ClosingError | CircuitBreakerError):
        return Unavailable(f"{target}: connection failed: {text}")
    if any(code in upper for code in _BUSY_CODES) or isinstance(exc, ExecAbortError):
        return Unavailable(f"{target}: the server refused the call: {text}")
    if isinstance(exc, RequestError):
        return Unavailable(f"{target}: request failed: {text}")
    return GatewayError(f"{target}: {type(exc).__name__}: {text}")


@contextlib.contextmanager
def glide_errors(target: str) -> Iterator[None]:
    """Turn any glide exception raised inside into its kvgate kind."""
    try:
        yield
    except GlideError as exc:
        error = to_gateway_error(exc, target)
        # An authentication failure is raised without its cause: nothing of the credentials
        # travels further than the message written above.
        raise error from (None if isinstance(error, ConfigError) else exc)


async def create_client(config: GlideConfig, target: str) -> Client:
    with glide_errors(target):
        if isinstance(config, GlideClusterClientConfiguration):
            return await GlideClusterClient.create(config)
        return await GlideClient.create(config)


async def close_quietly(client: Client) -> None:
    with contextlib.suppress(GlideError):
        await client.close()


class GlidePool:
    """``connections`` glide clients, created together on first use, closed together."""

    def __init__(self, endpoint: Endpoint, options: ValkeyOptions) -> None:
        self.endpoint = endpoint
        self.target = endpoint.display
        _glide_logs_errors_only()
        self._config = glide_config(endpoint, options)  # checks TLS files etc. now
        self._probe_tls = probe_tls(endpoint, options)
        self._connect_timeout = options.connect_timeout
        self._size = options.connections
        self._clients: list[Client] = []
        self._lock = asyncio.Lock()
        self._next = itertools.count()
        self._closed = False

    async def clients(self) -> list[Client]:
        if self._clients:
            return self._clients
        if self._closed:
            raise GatewayError(f"{self.target}: the connector is closed")
        async with self._lock:
            if not self._clients and not self._closed:
                # glide's create holds the loop while it connects: only once a server answers
                await server_answers(
                    self.target, self.endpoint.addresses, self._probe_tls, self._connect_timeout
                )
                made = await asyncio.gather(
                    *(create_client(self._config, self.target) for _ in range(self._size)),
                    return_exceptions=True,
                )
                good = [c for c in made if not isinstance(c, BaseException)]
                failed = [e for e in made if isinstance(e, BaseException)]
                if failed:
                    await asyncio.gather(*(close_quietly(c) for c in good))
                    raise failed[0]
                self._clients = good
        if self._closed:
            raise GatewayError(f"{self.target}: the connector is closed")
        return self._clients

    async def client(self) -> Client:
        """The next client, round-robin."""
        clients = await self.clients()
        return clients[next(self._next) % len(clients)]

    def start(self) -> int:
        """A rotating start index, so that part i of successive objects uses other clients."""
        return next(self._next)

    async def close(self) -> None:
        self._closed = True
        async with self._lock:
            clients, self._clients = self._clients, []
        await asyncio.gather(*(close_quietly(c) for c in clients))


def as_bytes(view: memoryview) -> bytes:
    """``view`` as ``bytes``: the object itself when the view spans a whole ``bytes``, else a
    copy (glide's public API would make the same copy of a memoryview)."""
    obj = view.obj
    if isinstance(obj, bytes) and view.nbytes == len(obj) and view.c_contiguous:
        return obj
    return view.tobytes()


def _ttl_ms(ttl: float) -> int:
    return max(1, round(ttl * 1000))


def _expiry(ttl: float | None) -> ExpirySet | None:
    return None if ttl is None else ExpirySet(ExpiryType.MILLSEC, _ttl_ms(ttl))


BatchBuilder = Callable[[Any], object]
"""Queues commands on a glide ``Batch`` or ``ClusterBatch`` (both have the same methods)."""


class GlideParts:
    """``PartBackend`` on glide (see ``gateway.parts``); keys are already namespaced bytes."""

    def __init__(self, pool: GlidePool, concurrency: int) -> None:
        self.pool = pool
        self._concurrency = concurrency
        self._slots = asyncio.Semaphore(concurrency)

    async def _one(self, call: Callable[[Client], Awaitable[T]], client: Client | None = None) -> T:
        """One request on ``client`` (or the next one), errors mapped."""
        with glide_errors(self.pool.target):
            return await call(client or await self.pool.client())

    async def _spread(self, count: int, call: Callable[[int, Client], Awaitable[bool]]) -> bool:
        """Whether ``call(i, client)`` is True for every i in range(count): spread over the
        clients, at most ``concurrency`` in flight (by as many workers, not a task per call),
        the first False ends it. Every call is finished (or never started) on return: none
        outlives it to read the caller's buffers or write into its destination."""
        clients = await self.pool.clients()
        start = self.pool.start()

        async def run(i: int) -> bool:
            async with self._slots:
                return await self._one(lambda c: call(i, c), clients[(start + i) % len(clients)])

        return await bounded_all(count, self._concurrency, run)

    async def _atomic(self, key: bytes, build: BatchBuilder) -> list[object]:
        """``build``'s commands on ``key``'s node as one MULTI/EXEC transaction."""
        client = await self.pool.client()
        with glide_errors(self.pool.target):
            if isinstance(client, GlideClusterClient):
                batch = ClusterBatch(is_atomic=True)
                build(batch)
                result = await client.exec(batch, raise_on_error=True)
            else:
                batch = Batch(is_atomic=True)
                build(batch)
                result = await client.exec(batch, raise_on_error=True)
        if result is None:  # only a WATCH makes EXEC return nil; none is used
            raise Unavailable(f"{self.pool.target}: transaction on {key!r} was aborted")
        return list(result)

    # -- PartBackend ----------------------------------------------------------------------

    async def read(self, key: bytes) -> Buffer | None:
        return await self._one(lambda c: c.get(key))

    async def read_parts_into(self, keys: Sequence[bytes], dsts: Sequence[memoryview]) -> bool:
        async def fetch(i: int, client: Client) -> bool:
            value = await client.get(keys[i])
            if value is None or len(value) != dsts[i].nbytes:
                return False
            dsts[i][:] = value
            return True

        return await self._spread(len(keys), fetch)

    async def write_parts(self, items: Sequence[tuple[bytes, memoryview]], ttl: float) -> None:
        expiry = _expiry(ttl)

        async def store(i: int, client: Client) -> bool:
            key, value = items[i]
            await client.set(key, as_bytes(value), expiry=expiry)
            return True

        await self._spread(len(items), store)

    async def swap(
        self, key: bytes, value: Sequence[memoryview], ttl: float | None
    ) -> Buffer | None:
        """Set ``key`` and return the HEAD of the value it replaced (its first
        ``MANIFEST_SIZE`` bytes): all that ``StripedObjects`` reads of it, since a manifest is
        exactly that long and an inline value is told by its first byte."""
        data = as_bytes(value[0]) if len(value) == 1 else b"".join(value)
        expiry = _expiry(ttl)

        def build(batch: Any) -> object:
            return batch.getrange(key, 0, MANIFEST_SIZE - 1).set(key, data, expiry=expiry)

        head = (await self._atomic(key, build))[0]
        assert isinstance(head, bytes)
        return head or None  # GETRANGE of a missing key is empty; stored values never are

    async def take(self, key: bytes) -> Buffer | None:
        """Delete ``key``; the HEAD of its value (see ``swap``), or None if it was absent."""

        def build(batch: Any) -> object:
            return batch.getrange(key, 0, MANIFEST_SIZE - 1).delete([key])

        head, removed = await self._atomic(key, build)
        assert isinstance(head, bytes)
        return head if removed else None

    async def head_and_length(self, key: bytes) -> tuple[bytes, int]:
        """The first ``MANIFEST_SIZE`` bytes of ``key``'s value and its length, read together
        (0 and empty when absent)."""

        def build(batch: Any) -> object:
            return batch.getrange(key, 0, MANIFEST_SIZE - 1).strlen(key)

        head, length = await self._atomic(key, build)
        assert isinstance(head, bytes)
        assert isinstance(length, int)
        return head, length

    async def set_ttl(self, keys: Sequence[bytes], ttl: float | None) -> None:
        ms = None if ttl is None else _ttl_ms(ttl)

        async def apply(i: int, client: Client) -> bool:
            if ms is None:
                await client.persist(keys[i])
            else:
                await client.pexpire(keys[i], ms)
            return True  # a part already gone is found by the next read

        await self._spread(len(keys), apply)

    async def remove(self, keys: Sequence[bytes]) -> None:
        # A DEL of up to _DEL_KEYS keys (glide splits one by slot in a cluster): one DEL per
        # key let a connection reset part-way leave the rest of an object's parts for ever.
        chunks = [list(keys[i : i + _DEL_KEYS]) for i in range(0, len(keys), _DEL_KEYS)]

        async def delete(i: int, client: Client) -> bool:
            await client.delete(chunks[i])
            return True

        await self._spread(len(chunks), delete)
