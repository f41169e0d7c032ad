"""Cross-cutting concerns as connector wrappers folded into a stack.

Every layer wraps an inner ``Connector`` and is itself one, so a tier sees a single connector
whatever is stacked on it (OpenDAL's layers, Starlette's middleware). ``Layer`` forwards every
Protocol method explicitly, so mypy checks each signature and a forgotten method shows up in
``tests/test_layers.py`` instead of at run time.

Each forwarding method sends its call through one hook, ``Layer._call(op, call)``; most layers
only override that hook. ``call`` is a zero-argument factory rather than a coroutine, so a layer
that refuses a call (breaker open, chaos down) never creates a coroutine it would have to close,
and a retrying layer can make a fresh one per attempt.

``list`` is an async iterator: the base class sends each step (fetching up to ``list_batch``
items) through the hook, so timeouts, permits, breaker accounting and metrics apply per step
and nothing is held while the consumer is between steps. ``usage`` is synchronous bookkeeping
and is forwarded untouched by every layer.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from gateway.connector import Allocator, Connector, parts_len
from gateway.deadlines import Deadlines
from gateway.errors import CircuitOpen, ConfigError, GatewayError, Timeout, Unavailable
from gateway.types import Buffer, BufferParts, Capabilities, ObjectInfo, TierStats

log = logging.getLogger("kvgate.layers")

T = TypeVar("T")
L = TypeVar("L", bound="Layer")
WRITE_OPS = frozenset({"put", "put_many"})

BreakerState = Literal["closed", "open", "half_open"]


async def _next(it: AsyncIterator[ObjectInfo]) -> ObjectInfo | None:
    """The next item, or None at the end (StopAsyncIteration must not cross the hooks: the
    breaker and the metrics would count it as a failure)."""
    try:
        return await anext(it)
    except StopAsyncIteration:
        return None


async def _next_batch(it: AsyncIterator[ObjectInfo], size: int) -> list[ObjectInfo]:
    """Up to ``size`` next items; fewer only at the end (see _next)."""
    batch: list[ObjectInfo] = []
    try:
        while len(batch) < size:
            batch.append(await anext(it))
    except StopAsyncIteration:
        pass
    return batch


async def _aclose(it: AsyncIterator[ObjectInfo]) -> None:
    # Close the inner iterator now rather than at garbage collection, so its connection or
    # file handle is released when a listing stops early or fails.
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        await aclose()


class Layer:
    """A connector that forwards everything to ``inner``; subclasses override what they need."""

    # Items of a listing one hooked call reads (one timeout, permit and latency sample): a
    # call per item cost ~30 us through the default stack, 30 s to start listing 1M keys.
    # Backends list by the page (S3 1000 keys, SCAN's batches), so a batch is about one
    # round trip.
    list_batch = 256

    def __init__(self, inner: Connector) -> None:
        self.inner = inner

    # Attributes read through to the connector, so one that learns its capabilities when it
    # connects is seen correctly through the whole stack.
    @property
    def scheme(self) -> str:
        return self.inner.scheme

    @property
    def capabilities(self) -> Capabilities:
        return self.inner.capabilities

    async def _call(self, op: str, call: Callable[[], Awaitable[T]]) -> T:
        """Run one call of operation ``op``; the single hook most layers override."""
        return await call()

    async def get(self, key: str) -> Buffer | None:
        return await self._call("get", lambda: self.inner.get(key))

    async def put(self, key: str, data: BufferParts) -> None:
        await self._call("put", lambda: self.inner.put(key, data))

    async def exists(self, key: str) -> bool:
        return await self._call("exists", lambda: self.inner.exists(key))

    async def delete(self, key: str) -> bool:
        return await self._call("delete", lambda: self.inner.delete(key))

    async def close(self) -> None:
        await self._call("close", self.inner.close)

    async def get_into(self, key: str, alloc: Allocator) -> memoryview | None:
        return await self._call("get_into", lambda: self.inner.get_into(key, alloc))

    async def get_many(self, keys: Sequence[str]) -> list[Buffer | None]:
        return await self._call("get_many", lambda: self.inner.get_many(keys))

    async def put_many(self, items: Sequence[tuple[str, BufferParts]]) -> None:
        await self._call("put_many", lambda: self.inner.put_many(items))

    async def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return await self._call("exists_many", lambda: self.inner.exists_many(keys))

    async def ping(self) -> bool:
        return await self._call("ping", self.inner.ping)

    def usage(self) -> tuple[int, int | None]:
        return self.inner.usage()

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        it = self.inner.list(prefix)
        size = self.list_batch
        try:
            while True:
                batch = await self._call("list", lambda: _next_batch(it, size))
                for item in batch:
                    yield item
                if len(batch) < size:
                    return
        finally:
            await _aclose(it)

    async def __aenter__(self: L) -> L:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _describe(self) -> str:
        return ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._describe()}) -> {self.inner!r}"


class TimeoutLayer(Layer):
    """Bounds every call (each ``list`` batch, and ``close``) by ``seconds``."""

    def __init__(self, inner: Connector, seconds: float) -> None:
        if not seconds > 0:
            raise ConfigError(f"timeout must be > 0 seconds, got {seconds!r}")
        super().__init__(inner)
        self._deadlines = Deadlines(seconds)

    @property
    def seconds(self) -> float:
        return self._deadlines.seconds

    async def _call(self, op: str, call: Callable[[], Awaitable[T]]) -> T:
        deadline = self._deadlines.start()
        try:
            with deadline:
                return await call()
        except TimeoutError as exc:
            # Only our own deadline becomes Timeout (also when the connector turned its
            # cancellation into a TimeoutError of its own); a TimeoutError the connector raised
            # before it (a socket timeout is an OSError) passes on for the retry layer to judge.
            if not deadline.expired:
                raise
            raise Timeout(
                f"{self.scheme}:// {op} did not finish within {self.seconds:g} s"
            ) from exc

    def _describe(self) -> str:
        return f"{self.seconds:g}s"


class RetryLayer(Layer):
    """Retries retryable failures with full-jitter exponential backoff.

    Every operation is idempotent (a put overwrites), so all are retried. A ``list`` is retried
    only until its first item arrives: after that the consumer has seen items and a restart
    would repeat them. ``close`` is never retried. ``CircuitOpen`` is retryable for a caller
    in general but retrying it here would only spin against an open breaker, so it propagates.
    """

    def __init__(
        self,
        inner: Connector,
        attempts: int,
        backoff_base: float,
        backoff_max: float,
        *,
        rng: random.Random | None = None,
    ) -> None:
        if attempts < 1:
            raise ConfigError(f"retry attempts must be >= 1, got {attempts!r}")
        if backoff_base < 0 or backoff_max < 0:
            raise ConfigError("retry backoff must be >= 0 seconds")
        super().__init__(inner)
        self.attempts = attempts
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self.retries = 0  # total retries made, for tests and diagnostics
        self._rng = rng if rng is not None else random.Random()

    @staticmethod
    def retryable(exc: BaseException) -> bool:
        if isinstance(exc, CircuitOpen):
            return False
        if isinstance(exc, GatewayError):
            return exc.retryable
        # Connection resets and socket timeouts from a connector that did not map them.
        return isinstance(exc, OSError)

    def backoff(self, n: int) -> float:
        """Seconds to sleep before retry number ``n`` (0-based): full jitter (AWS style)."""
        return self._rng.uniform(0, min(self.backoff_max, self.backoff_base * 2**n))

    async def _call(self, op: str, call: Callable[[], Awaitable[T]]) -> T:
        for n in range(self.attempts - 1):
            try:
                return await call()
            except Exception as exc:
                if not self.retryable(exc):
                    raise
            self.retries += 1
            await asyncio.sleep(self.backoff(n))
        return await call()

    async def close(self) -> None:
        await self.inner.close()

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        async def start() -> tuple[AsyncIterator[ObjectInfo], ObjectInfo | None]:
            it = self.inner.list(prefix)
            try:
                return it, await _next(it)
            except BaseException:
                await _aclose(it)
                raise

        it, item = await self._call("list", start)
        try:
            while item is not None:
                yield item
                item = await _next(it)
        finally:
            await _aclose(it)

    def _describe(self) -> str:
        return f"{self.attempts}x, {self.backoff_base:g}..{self.backoff_max:g}s"


class CircuitBreakerLayer(Layer):
    """Fails fast while the backend is unhealthy.

    ``failures`` consecutive failed calls open the breaker; while open, calls raise
    ``CircuitOpen`` without reaching the connector. After ``reset_after`` seconds one probe call
    goes through (half-open): success closes the breaker, failure re-opens it. Only failures
    that say something about the backend's health count (``Unavailable`` and its kinds, and
    unmapped exceptions such as ``OSError``); a corrupt object, a bad key, an unsupported
    operation or a full backend is the caller's or the object's problem, and a miss is not a
    failure at all. ``failures=0`` disables the breaker. ``close`` always goes through, so
    resources are released even while the backend is considered down.

    An outage is a few log lines, not one per refused call: the breaker opening (a warning,
    with the failure that opened it), the first half-open probe, and the breaker closing again
    (with how long it was open and how many calls and writes it refused meanwhile). Probes that
    fail in between are logged at debug level. ``name`` labels the lines (the tier's name).
    """

    def __init__(
        self, inner: Connector, failures: int, reset_after: float, *, name: str | None = None
    ) -> None:
        if failures < 0:
            raise ConfigError(f"breaker failures must be >= 0, got {failures!r}")
        if reset_after < 0:
            raise ConfigError(f"breaker reset_after must be >= 0, got {reset_after!r}")
        super().__init__(inner)
        self.failures = failures
        self.reset_after = reset_after
        self.name = name
        self._state: BreakerState = "closed"
        self._consecutive = 0
        self._opened_at = 0.0
        self._probing = False  # a half-open probe is in flight
        # The current outage (from opening until closing again), for its log lines.
        self._outage_since: float | None = None
        self._refused: Counter[str] = Counter()  # calls refused, by operation
        self._probed = False  # the outage's first probe was logged

    @property
    def state(self) -> BreakerState:
        # An open breaker whose reset period has passed lets the next call probe; report that
        # as half-open even before the call arrives, so metrics show what a caller will get.
        if self._state == "open" and time.monotonic() - self._opened_at >= self.reset_after:
            return "half_open"
        return self._state

    @staticmethod
    def counts_as_failure(exc: BaseException) -> bool:
        if isinstance(exc, GatewayError):
            return isinstance(exc, Unavailable)
        return isinstance(exc, Exception)  # not cancellation

    def _admit(self, op: str) -> bool:
        """Let a call through or raise CircuitOpen; True when the call is the half-open probe."""
        state = self.state
        if state == "closed":
            return False
        if state == "half_open" and not self._probing:
            self._state = "half_open"
            self._probing = True
            if not self._probed:
                self._probed = True
                log.info(
                    "%s: circuit breaker half-open, probing with one %s (refused so far: %s)",
                    self._label(),
                    op,
                    self._refusals(),
                )
            return True
        self._refused[op] += 1
        wait = max(0.0, self._opened_at + self.reset_after - time.monotonic())
        raise CircuitOpen(f"{self.scheme}:// circuit open, {op} refused (retry in {wait:.2f} s)")

    def _label(self) -> str:
        return f"tier {self.name}" if self.name else f"{self.scheme}://"

    def _refusals(self) -> str:
        total = sum(self._refused.values())
        writes = sum(n for op, n in self._refused.items() if op in WRITE_OPS)
        return f"{total} calls ({writes} writes)"

    def _open(self, cause: BaseException) -> None:
        now = time.monotonic()
        if self._outage_since is None:
            self._outage_since = now
            log.warning(
                "%s: circuit breaker open after %d consecutive failures (last: %s); "
                "calls fail fast, next probe in %g s",
                self._label(),
                self.failures,
                _describe_error(cause),
                self.reset_after,
            )
        else:
            log.debug(
                "%s: probe failed (%s), circuit breaker open again (refused so far: %s)",
                self._label(),
                _describe_error(cause),
                self._refusals(),
            )
        self._state = "open"
        self._opened_at = now
        self._consecutive = 0
        self._probing = False

    def _close(self) -> None:
        self._state = "closed"
        self._probing = False
        if self._outage_since is not None:
            log.info(
                "%s: circuit breaker closed, the backend answers again after %.1f s; "
                "refused %s while open",
                self._label(),
                time.monotonic() - self._outage_since,
                self._refusals(),
            )
        self._outage_since = None
        self._refused.clear()
        self._probed = False

    async def _call(self, op: str, call: Callable[[], Awaitable[T]]) -> T:
        if self.failures == 0:
            return await call()
        probe = self._admit(op)
        try:
            result = await call()
        except BaseException as exc:
            if self.counts_as_failure(exc):
                if probe:
                    self._open(exc)
                else:
                    self._consecutive += 1
                    if self._state == "closed" and self._consecutive >= self.failures:
                        self._open(exc)
            elif probe:
                # The probe told us nothing about health (a bad key, a cancellation):
                # stay half-open and let the next call probe.
                self._probing = False
            raise
        if probe:
            self._close()
        self._consecutive = 0
        return result

    async def close(self) -> None:
        await self.inner.close()

    def _describe(self) -> str:
        return f"{self.state}, {self.failures} failures, {self.reset_after:g}s"


class LimitLayer(Layer):
    """At most ``max_concurrency`` calls in flight; a batch call takes one permit.

    ``close`` takes no permit: shutdown must not queue behind a backlog of slow calls.
    """

    def __init__(self, inner: Connector, max_concurrency: int) -> None:
        if max_concurrency < 1:
            raise ConfigError(f"concurrency must be >= 1, got {max_concurrency!r}")
        super().__init__(inner)
        self.max_concurrency = max_concurrency
        self.in_flight = 0
        self.waiting = 0
        self._sem = asyncio.Semaphore(max_concurrency)

    async def _call(self, op: str, call: Callable[[], Awaitable[T]]) -> T:
        self.waiting += 1
        try:
            await self._sem.acquire()
        finally:
            self.waiting -= 1
        self.in_flight += 1
        try:
            return await call()
        finally:
            self.in_flight -= 1
            self._sem.release()

    async def close(self) -> None:
        await self.inner.close()

    def _describe(self) -> str:
        return f"{self.in_flight}/{self.max_concurrency}"


class MetricsLayer(Layer):
    """Counts every call into a ``TierStats``: latency per op, hits/misses, bytes, errors.

    Latency is observed for calls that finished (successfully or with an error), not for
    cancelled ones. Errors are counted by ``kind``, ``"internal"`` for non-kvgate exceptions.
    Corrupt objects are counted by the store, which is the one that verifies frames.
    """

    def __init__(self, inner: Connector, stats: TierStats) -> None:
        super().__init__(inner)
        self.stats = stats

    async def _call(self, op: str, call: Callable[[], Awaitable[T]]) -> T:
        start = time.perf_counter()
        try:
            result = await call()
        except GatewayError as exc:
            self.stats.count_error(exc.kind)
            self.stats.observe(op, time.perf_counter() - start)
            raise
        except Exception:
            self.stats.count_error("internal")
            self.stats.observe(op, time.perf_counter() - start)
            raise
        self.stats.observe(op, time.perf_counter() - start)
        return result

    def _read(self, data: Buffer | None) -> None:
        if data is None:
            self.stats.misses += 1
        else:
            self.stats.hits += 1
            self.stats.bytes_read += memoryview(data).nbytes

    async def get(self, key: str) -> Buffer | None:
        data = await super().get(key)
        self._read(data)
        return data

    async def get_into(self, key: str, alloc: Allocator) -> memoryview | None:
        data = await super().get_into(key, alloc)
        self._read(data)
        return data

    async def get_many(self, keys: Sequence[str]) -> list[Buffer | None]:
        found = await super().get_many(keys)
        for data in found:
            self._read(data)
        return found

    async def put(self, key: str, data: BufferParts) -> None:
        # Measured before the call: the caller may reuse its buffers once put returns.
        size = parts_len(data)
        await super().put(key, data)
        self.stats.puts += 1
        self.stats.bytes_written += size

    async def put_many(self, items: Sequence[tuple[str, BufferParts]]) -> None:
        size = sum(parts_len(data) for _, data in items)
        await super().put_many(items)
        self.stats.puts += len(items)
        self.stats.bytes_written += size

    def _describe(self) -> str:
        return repr(self.stats.name)


@dataclass(frozen=True, slots=True)
class ChaosOptions:
    """Options of ``ChaosLayer`` as a value, for ``build_stack`` and the config."""

    fail_rate: float = 0.0
    latency: float = 0.0
    down: bool = False
    seed: int | None = None


class ChaosLayer(Layer):
    """Fault injection over a real connector, for tests of the layers above and of the store.

    Before each call it sleeps ``latency`` seconds, then raises ``Unavailable`` if ``down`` or
    with probability ``fail_rate``. The attributes may be changed at any time (tests flip
    ``down`` to take a backend away and bring it back). ``close`` is never faulted, so a test
    that takes the backend down can still shut its store down cleanly.
    """

    def __init__(
        self,
        inner: Connector,
        *,
        fail_rate: float = 0.0,
        latency: float = 0.0,
        down: bool = False,
        seed: int | None = None,
    ) -> None:
        if not 0.0 <= fail_rate <= 1.0:
            raise ConfigError(f"chaos fail_rate must be within [0, 1], got {fail_rate!r}")
        if latency < 0:
            raise ConfigError(f"chaos latency must be >= 0, got {latency!r}")
        super().__init__(inner)
        self.fail_rate = fail_rate
        self.latency = latency
        self.down = down
        self.injected = 0  # faults raised so far
        self._rng = random.Random(seed)

    async def _call(self, op: str, call: Callable[[], Awaitable[T]]) -> T:
        if self.latency > 0:
            await asyncio.sleep(self.latency)
        if self.down:
            self.injected += 1
            raise Unavailable("chaos: backend down")
        if self.fail_rate > 0 and self._rng.random() < self.fail_rate:
            self.injected += 1
            raise Unavailable(f"chaos: injected failure in {op}")
        return await call()

    async def close(self) -> None:
        await self.inner.close()

    def _describe(self) -> str:
        down = ", down" if self.down else ""
        return f"fail_rate={self.fail_rate:g}, latency={self.latency:g}s{down}"


def build_stack(
    connector: Connector,
    *,
    timeout: float | None = None,
    retry: tuple[int, float, float] | None = None,
    breaker: tuple[int, float] | None = None,
    concurrency: int | None = None,
    stats: TierStats | None = None,
    chaos: ChaosOptions | Mapping[str, Any] | None = None,
) -> Connector:
    """Wrap ``connector`` in the configured layers; ``None`` (or a no-op setting) omits one.

    Outermost first: Metrics -> CircuitBreaker -> Timeout -> Retry -> Limit -> Chaos -> connector.

    - The timeout sits outside the retries, so it bounds the whole call as the caller sees it,
      backoff sleeps included, rather than each attempt (which would multiply the deadline).
    - The breaker sits outside the timeout and the retries, so it counts the outcome of whole
      calls: a call that succeeded on its second attempt is a success, and a call that timed
      out is one failure however many attempts it made.
    - The limit sits inside the timeout, so time spent queueing for a permit counts against the
      deadline: an overloaded tier times out instead of building an unbounded wait. It sits
      inside the retries, so a call sleeping between attempts holds no permit.
    - Metrics is outermost, so it sees what the caller sees, breaker refusals included.
    - Chaos sits right on the connector, standing in for the backend's own faults.
    """
    stack: Connector = connector
    if chaos is not None:
        if not isinstance(chaos, ChaosOptions):
            try:
                chaos = ChaosOptions(**dict(chaos))
            except TypeError as exc:
                raise ConfigError(f"invalid chaos options: {exc}") from exc
        stack = ChaosLayer(
            stack,
            fail_rate=chaos.fail_rate,
            latency=chaos.latency,
            down=chaos.down,
            seed=chaos.seed,
        )
    if concurrency is not None:
        stack = LimitLayer(stack, concurrency)
    if retry is not None and retry[0] > 1:
        stack = RetryLayer(stack, *retry)
    if timeout is not None:
        stack = TimeoutLayer(stack, timeout)
    if breaker is not None and breaker[0] > 0:
        name = stats.name if stats is not None else None
        stack = CircuitBreakerLayer(stack, *breaker, name=name)
    if stats is not None:
        stack = MetricsLayer(stack, stats)
    return stack


def _describe_error(exc: BaseException) -> str:
    kind = exc.kind if isinstance(exc, GatewayError) else type(exc).__name__
    return f"{kind}: {exc}"


def find_layer(stack: Connector, cls: type[L]) -> L | None:
    """The outermost layer of type ``cls`` in ``stack``, or None."""
    node: Connector | None = stack
    while isinstance(node, Layer):
        if isinstance(node, cls):
            return node
        node = node.inner
    return None
