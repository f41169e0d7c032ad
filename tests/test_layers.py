"""Tests of gateway.layers over a real in-memory connector.

The helpers below (Recorder, Flaky, Tracker, SlowClose) are layers that stand in for a backend's
behaviour underneath the layer under test; the layer under test itself is always the real one.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import pytest

import gateway.layers as layers_module
from connectors.memory import MemoryConnector
from gateway.connector import PROTOCOL_METHODS, Allocator, Connector
from gateway.errors import (
    CapacityError,
    CircuitOpen,
    ConfigError,
    CorruptObject,
    InvalidKey,
    Timeout,
    Unavailable,
    Unsupported,
)
from gateway.layers import (
    ChaosLayer,
    ChaosOptions,
    CircuitBreakerLayer,
    Layer,
    LimitLayer,
    MetricsLayer,
    RetryLayer,
    TimeoutLayer,
    build_stack,
    find_layer,
)
from gateway.types import Buffer, BufferParts, ObjectInfo, TierStats

T = TypeVar("T")


async def make_backend() -> Connector:
    backend = MemoryConnector()
    for key, value in (("k1", b"one"), ("k2", b"two!"), ("k3", b"three")):
        await backend.put(key, value)
    return backend


def alloc(n: int) -> memoryview:
    return memoryview(bytearray(n))


# ---------------------------------------------------------------------------------------------
# Helpers underneath the layer under test


class Recorder(Layer):
    """Records each call, its arguments and what the connector returned.

    Forwards by calling ``self.inner`` directly in every method, never through Layer's own
    forwarding, so a forwarding bug in Layer cannot hide behind the recorder.
    """

    def __init__(self, inner: Connector) -> None:
        super().__init__(inner)
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.results: list[Any] = []

    async def _record(self, name: str, args: tuple[Any, ...], call: Awaitable[T]) -> T:
        self.calls.append((name, args))
        result = await call
        self.results.append(result)
        return result

    async def get(self, key: str) -> Buffer | None:
        return await self._record("get", (key,), self.inner.get(key))

    async def put(self, key: str, data: BufferParts) -> None:
        await self._record("put", (key, data), self.inner.put(key, data))

    async def exists(self, key: str) -> bool:
        return await self._record("exists", (key,), self.inner.exists(key))

    async def delete(self, key: str) -> bool:
        return await self._record("delete", (key,), self.inner.delete(key))

    async def close(self) -> None:
        await self._record("close", (), self.inner.close())

    async def get_into(self, key: str, alloc: Allocator) -> memoryview | None:
        return await self._record("get_into", (key, alloc), self.inner.get_into(key, alloc))

    async def get_many(self, keys: Sequence[str]) -> list[Buffer | None]:
        return await self._record("get_many", (keys,), self.inner.get_many(keys))

    async def put_many(self, items: Sequence[tuple[str, BufferParts]]) -> None:
        await self._record("put_many", (items,), self.inner.put_many(items))

    async def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return await self._record("exists_many", (keys,), self.inner.exists_many(keys))

    async def ping(self) -> bool:
        return await self._record("ping", (), self.inner.ping())

    def usage(self) -> tuple[int, int | None]:
        self.calls.append(("usage", ()))
        result = self.inner.usage()
        self.results.append(result)
        return result

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        self.calls.append(("list", (prefix,)))
        items: list[ObjectInfo] = []
        self.results.append(items)
        async for info in self.inner.list(prefix):
            items.append(info)
            yield info


class Flaky(Layer):
    """Counts calls; call number i raises ``errors[i]`` when there is one (None passes)."""

    def __init__(self, inner: Connector, errors: Sequence[BaseException | None] = ()) -> None:
        super().__init__(inner)
        self.errors = list(errors)
        self.calls = 0

    async def _call(self, op: str, call: Callable[[], Awaitable[T]]) -> T:
        self.calls += 1
        error = self.errors.pop(0) if self.errors else None
        if error is not None:
            raise error
        return await call()


class Tracker(Layer):
    """Counts calls in flight at this point of the stack and the most seen at once."""

    def __init__(self, inner: Connector) -> None:
        super().__init__(inner)
        self.now = 0
        self.max = 0

    async def _call(self, op: str, call: Callable[[], Awaitable[T]]) -> T:
        self.now += 1
        self.max = max(self.max, self.now)
        try:
            return await call()
        finally:
            self.now -= 1


class SlowClose(Layer):
    async def close(self) -> None:
        await asyncio.sleep(5)


# ---------------------------------------------------------------------------------------------
# Every layer forwards every Protocol method

ARGS: dict[str, tuple[Any, ...]] = {
    "get": ("k1",),
    "put": ("k9", b"new"),
    "exists": ("k1",),
    "delete": ("k2",),
    "close": (),
    "get_into": ("k1", alloc),
    "get_many": (["k1", "missing"],),
    "put_many": ([("a", b"1"), ("b", [b"2", b"34"])],),
    "exists_many": (["k1", "missing"],),
    "list": ("k",),
    "ping": (),
    "usage": (),
}

LAYERS: dict[str, Callable[[Connector], Connector]] = {
    "Layer": Layer,
    "TimeoutLayer": lambda c: TimeoutLayer(c, 5.0),
    "RetryLayer": lambda c: RetryLayer(c, 3, 0.001, 0.01),
    "CircuitBreakerLayer": lambda c: CircuitBreakerLayer(c, 3, 1.0),
    "LimitLayer": lambda c: LimitLayer(c, 2),
    "MetricsLayer": lambda c: MetricsLayer(c, TierStats("t")),
    "ChaosLayer": ChaosLayer,
    "build_stack": lambda c: build_stack(
        c,
        timeout=5.0,
        retry=(3, 0.001, 0.01),
        breaker=(3, 1.0),
        concurrency=2,
        stats=TierStats("t"),
        chaos=ChaosOptions(),
    ),
}


async def invoke(conn: Connector, name: str, args: tuple[Any, ...]) -> Any:
    method = getattr(conn, name)
    if name == "list":
        return [info async for info in method(*args)]
    if name == "usage":
        return method()
    return await method(*args)


def test_the_forwarding_table_covers_the_protocol() -> None:
    # Adding a method to the Protocol must break this file until the test covers it.
    assert set(ARGS) == set(PROTOCOL_METHODS)
    assert set(PROTOCOL_METHODS) <= set(vars(Recorder))
    assert set(PROTOCOL_METHODS) <= set(vars(Layer))


def test_every_layer_class_is_tested() -> None:
    classes = {
        obj.__name__
        for obj in vars(layers_module).values()
        if isinstance(obj, type) and issubclass(obj, Layer)
    }
    assert classes <= set(LAYERS)


@pytest.mark.parametrize("method", PROTOCOL_METHODS)
@pytest.mark.parametrize("layer", list(LAYERS))
async def test_layer_forwards_method(layer: str, method: str) -> None:
    recorder = Recorder(await make_backend())
    stack = LAYERS[layer](recorder)
    assert isinstance(stack, Connector)

    result = await invoke(stack, method, ARGS[method])

    assert recorder.calls == [(method, ARGS[method])]
    assert len(recorder.results) == 1
    if method == "list":
        assert result == recorder.results[0]
        assert [info.key for info in result] == ["k1", "k2", "k3"]
    else:
        # The very object the connector returned, not a copy or a re-wrapped value.
        assert result is recorder.results[0]


@pytest.mark.parametrize("layer", list(LAYERS))
async def test_layer_forwards_attributes(layer: str) -> None:
    backend = await make_backend()
    stack = LAYERS[layer](backend)
    assert stack.scheme == backend.scheme
    assert stack.capabilities == backend.capabilities
    node = stack
    while isinstance(node, Layer):
        node = node.inner
    assert node is backend


async def test_list_stopped_early_closes_the_inner_iterator() -> None:
    stack = build_stack(await make_backend(), timeout=1.0, retry=(3, 0.0, 0.0), concurrency=1)
    listing = stack.list("")
    assert isinstance(listing, AsyncIterator)
    assert (await anext(listing)).key == "k1"
    await listing.aclose()  # type: ignore[attr-defined]
    limit = find_layer(stack, LimitLayer)
    assert limit is not None
    assert limit.in_flight == 0


# ---------------------------------------------------------------------------------------------
# TimeoutLayer


async def test_timeout_fires_on_a_slow_call() -> None:
    stack = TimeoutLayer(ChaosLayer(await make_backend(), latency=5.0), 0.05)
    start = time.monotonic()
    with pytest.raises(Timeout, match=r"get .*0\.05 s"):
        await stack.get("k1")
    assert time.monotonic() - start < 3.0  # well under the 5 s (or 10 s) it would take


async def test_timeout_lets_fast_calls_through() -> None:
    stack = TimeoutLayer(ChaosLayer(await make_backend(), latency=0.001), 1.0)
    assert await stack.get("k1") == b"one"


async def test_timeout_bounds_each_list_batch_not_the_whole_listing() -> None:
    # 4 steps (3 items and the end) of 0.06 s each, read 2 a batch: each batch is within 0.2 s,
    # the whole is not.
    slow = TimeoutLayer(ChaosLayer(await make_backend(), latency=0.06), 0.2)
    slow.list_batch = 2
    assert len([info async for info in slow.list()]) == 3

    stuck = TimeoutLayer(ChaosLayer(await make_backend(), latency=5.0), 0.05)
    with pytest.raises(Timeout, match="list"):
        _ = [info async for info in stuck.list()]


async def test_timeout_bounds_close() -> None:
    stack = TimeoutLayer(SlowClose(await make_backend()), 0.05)
    with pytest.raises(Timeout, match="close"):
        await stack.close()


async def test_timeout_leaves_a_connectors_own_timeout_error_alone() -> None:
    stack = TimeoutLayer(Flaky(await make_backend(), [TimeoutError("socket")]), 1.0)
    with pytest.raises(TimeoutError, match="socket"):
        await stack.get("k1")


def test_timeout_rejects_nonpositive_seconds() -> None:
    with pytest.raises(ConfigError):
        TimeoutLayer(MemoryConnector(), 0)


# ---------------------------------------------------------------------------------------------
# RetryLayer


@pytest.mark.parametrize(
    "error",
    [Unavailable("x"), Timeout("x"), ConnectionResetError("x"), OSError("x")],
    ids=lambda e: type(e).__name__,
)
async def test_retry_retries_retryable_errors(error: BaseException) -> None:
    flaky = Flaky(await make_backend(), [error, error])
    retry = RetryLayer(flaky, 3, 0.001, 0.002)
    assert await retry.get("k1") == b"one"
    assert flaky.calls == 3
    assert retry.retries == 2


async def test_retry_gives_up_after_attempts() -> None:
    flaky = Flaky(await make_backend(), [Unavailable(str(i)) for i in range(10)])
    with pytest.raises(Unavailable, match="2"):
        await RetryLayer(flaky, 3, 0.001, 0.002).put("k", b"v")
    assert flaky.calls == 3


@pytest.mark.parametrize(
    "error",
    [CorruptObject("x"), InvalidKey("x"), Unsupported("x"), CapacityError("x"), ValueError("x")],
    ids=lambda e: type(e).__name__,
)
async def test_retry_does_not_retry_non_retryable_errors(error: BaseException) -> None:
    flaky = Flaky(await make_backend(), [error, error])
    with pytest.raises(type(error)):
        await RetryLayer(flaky, 3, 0.001, 0.002).get("k1")
    assert flaky.calls == 1


async def test_retry_does_not_retry_an_open_circuit() -> None:
    flaky = Flaky(await make_backend(), [CircuitOpen("open")])
    with pytest.raises(CircuitOpen):
        await RetryLayer(flaky, 3, 0.001, 0.002).get("k1")
    assert flaky.calls == 1


async def test_retry_sleeps_capped_exponential_backoff() -> None:
    class Ceiling(random.Random):
        def uniform(self, a: float, b: float) -> float:
            return b  # the largest sleep full jitter can pick

    flaky = Flaky(await make_backend(), [Unavailable(), Unavailable()])
    retry = RetryLayer(flaky, 3, 0.02, 0.03, rng=Ceiling())
    start = time.monotonic()
    await retry.get("k1")
    assert time.monotonic() - start >= 0.02 + 0.03  # 0.02 * 2**1 capped at 0.03


def test_retry_backoff_is_full_jitter_within_the_cap() -> None:
    retry = RetryLayer(MemoryConnector(), 5, 0.1, 1.0, rng=random.Random(7))
    for n in range(10):
        for _ in range(20):
            assert 0 <= retry.backoff(n) <= min(1.0, 0.1 * 2**n)


async def test_retry_restarts_a_list_that_fails_before_its_first_item() -> None:
    flaky = Flaky(await make_backend(), [Unavailable()])
    infos = [info async for info in RetryLayer(flaky, 3, 0.001, 0.002).list()]
    assert [info.key for info in infos] == ["k1", "k2", "k3"]


async def test_retry_does_not_retry_a_list_mid_iteration() -> None:
    flaky = Flaky(await make_backend(), [None, Unavailable("mid")])
    flaky.list_batch = 1  # its second item is its second call, which fails
    listing = RetryLayer(flaky, 3, 0.001, 0.002).list()
    assert (await anext(listing)).key == "k1"
    with pytest.raises(Unavailable, match="mid"):
        await anext(listing)
    assert flaky.calls == 2


async def test_a_listing_takes_one_call_per_batch_not_per_key() -> None:
    # A call per key cost ~30 us through the default stack: 30 s to start listing 1M keys.
    backend = MemoryConnector()
    for i in range(600):
        await backend.put(f"k{i:03d}", b"x")
    counted = Flaky(backend)
    keys = [info.key async for info in counted.list()]
    assert sorted(keys) == [f"k{i:03d}" for i in range(600)]
    assert counted.calls == 3  # 256 + 256 + 88


async def test_retry_does_not_retry_close() -> None:
    flaky = Flaky(await make_backend(), [Unavailable("close")])
    with pytest.raises(Unavailable):
        await RetryLayer(flaky, 3, 0.001, 0.002).close()
    assert flaky.calls == 1


def test_retry_rejects_zero_attempts() -> None:
    with pytest.raises(ConfigError):
        RetryLayer(MemoryConnector(), 0, 0.1, 1.0)


# ---------------------------------------------------------------------------------------------
# CircuitBreakerLayer


async def breaker_over_chaos(
    failures: int = 3, reset_after: float = 0.05, **chaos: Any
) -> tuple[CircuitBreakerLayer, Flaky, ChaosLayer]:
    chaos_layer = ChaosLayer(await make_backend(), **chaos)
    counter = Flaky(chaos_layer)
    return CircuitBreakerLayer(counter, failures, reset_after), counter, chaos_layer


async def test_breaker_opens_after_consecutive_failures_and_fails_fast() -> None:
    breaker, counter, _ = await breaker_over_chaos(down=True)
    for _ in range(3):
        assert breaker.state == "closed"
        with pytest.raises(Unavailable, match="chaos"):
            await breaker.get("k1")
    assert breaker.state == "open"
    for method in ("get", "exists", "ping", "list", "put_many"):
        args = {"put_many": ([("a", b"1")],)}.get(method, ARGS[method])
        with pytest.raises(CircuitOpen):
            await invoke(breaker, method, args)
    assert counter.calls == 3  # the inner connector was not touched while open


async def test_breaker_ignores_misses_and_errors_that_are_not_the_backends_health() -> None:
    errors = [CorruptObject(), InvalidKey(), Unsupported(), CapacityError()]
    counter = Flaky(await make_backend(), errors)
    breaker = CircuitBreakerLayer(counter, 2, 10.0)
    for error in errors:
        with pytest.raises(type(error)):
            await breaker.get("k1")
    for _ in range(5):
        assert await breaker.get("missing") is None
    assert breaker.state == "closed"


async def test_breaker_counts_unmapped_exceptions_as_failures() -> None:
    counter = Flaky(await make_backend(), [ConnectionRefusedError("refused"), OSError("reset")])
    breaker = CircuitBreakerLayer(counter, 2, 10.0)
    for _ in range(2):
        with pytest.raises(OSError, match=r"refused|reset"):
            await breaker.get("k1")
    assert breaker.state == "open"


async def test_breaker_needs_consecutive_failures() -> None:
    counter = Flaky(await make_backend(), [Unavailable(), Unavailable(), None, Unavailable()])
    breaker = CircuitBreakerLayer(counter, 3, 10.0)
    for _ in range(2):
        with pytest.raises(Unavailable):
            await breaker.get("k1")
    assert await breaker.get("k1") == b"one"
    with pytest.raises(Unavailable):
        await breaker.get("k1")
    assert breaker.state == "closed"


async def test_breaker_half_opens_and_closes_on_success() -> None:
    breaker, counter, chaos = await breaker_over_chaos(down=True)
    for _ in range(3):
        with pytest.raises(Unavailable):
            await breaker.get("k1")
    await asyncio.sleep(0.08)
    assert breaker.state == "half_open"
    chaos.down = False
    assert await breaker.get("k1") == b"one"
    assert breaker.state == "closed"
    assert counter.calls == 4
    assert await breaker.exists("k1") is True


async def test_breaker_reopens_when_the_probe_fails() -> None:
    breaker, counter, _ = await breaker_over_chaos(down=True)
    for _ in range(3):
        with pytest.raises(Unavailable):
            await breaker.get("k1")
    await asyncio.sleep(0.08)
    with pytest.raises(Unavailable, match="chaos"):
        await breaker.get("k1")  # the probe
    assert breaker.state == "open"
    with pytest.raises(CircuitOpen):
        await breaker.get("k1")
    assert counter.calls == 4
    # And after another reset period it probes again.
    await asyncio.sleep(0.08)
    assert breaker.state == "half_open"


async def test_breaker_lets_one_probe_through_at_a_time() -> None:
    breaker, counter, chaos = await breaker_over_chaos(down=True)
    for _ in range(3):
        with pytest.raises(Unavailable):
            await breaker.get("k1")
    await asyncio.sleep(0.08)
    chaos.down = False
    chaos.latency = 0.03
    results = await asyncio.gather(breaker.get("k1"), breaker.get("k2"), return_exceptions=True)
    assert results[0] == b"one"
    assert isinstance(results[1], CircuitOpen)
    assert counter.calls == 4
    assert breaker.state == "closed"


async def test_breaker_probe_with_a_neutral_error_keeps_it_half_open() -> None:
    breaker, counter, chaos = await breaker_over_chaos(down=True)
    for _ in range(3):
        with pytest.raises(Unavailable):
            await breaker.get("k1")
    await asyncio.sleep(0.08)
    chaos.down = False
    counter.errors = [InvalidKey("bad")]
    with pytest.raises(InvalidKey):
        await breaker.get("bad")
    assert breaker.state == "half_open"
    assert await breaker.get("k1") == b"one"
    assert breaker.state == "closed"


async def test_breaker_with_zero_failures_is_disabled() -> None:
    breaker, counter, _ = await breaker_over_chaos(failures=0, down=True)
    for _ in range(10):
        with pytest.raises(Unavailable, match="chaos"):
            await breaker.get("k1")
    assert breaker.state == "closed"
    assert counter.calls == 10


async def test_breaker_lets_close_through_while_open() -> None:
    recorder = Recorder(await make_backend())
    breaker = CircuitBreakerLayer(ChaosLayer(recorder, down=True), 1, 10.0)
    with pytest.raises(Unavailable):
        await breaker.get("k1")
    assert breaker.state == "open"
    await breaker.close()
    assert recorder.calls == [("close", ())]


# ---------------------------------------------------------------------------------------------
# LimitLayer


async def test_limit_bounds_concurrency() -> None:
    tracker = Tracker(ChaosLayer(await make_backend(), latency=0.02))
    limit = LimitLayer(tracker, 2)
    results = await asyncio.gather(*(limit.get(f"k{i % 3 + 1}") for i in range(10)))
    assert results[:3] == [b"one", b"two!", b"three"]
    assert tracker.max == 2
    assert limit.in_flight == 0
    assert limit.waiting == 0


async def test_limit_gives_a_batch_call_one_permit() -> None:
    limit = LimitLayer(ChaosLayer(await make_backend(), latency=0.05), 1)
    batch = asyncio.create_task(limit.get_many(["k1", "k2", "k3"]))
    await asyncio.sleep(0.01)
    assert (limit.in_flight, limit.waiting) == (1, 0)
    single = asyncio.create_task(limit.get("k1"))
    await asyncio.sleep(0.01)
    assert (limit.in_flight, limit.waiting) == (1, 1)
    assert await batch == [b"one", b"two!", b"three"]
    assert await single == b"one"
    assert (limit.in_flight, limit.waiting) == (0, 0)


async def test_limit_releases_permits_on_errors() -> None:
    chaos = ChaosLayer(await make_backend(), down=True)
    limit = LimitLayer(chaos, 1)
    for _ in range(3):
        with pytest.raises(Unavailable):
            await limit.get("k1")
    chaos.down = False
    assert await asyncio.wait_for(limit.get("k1"), 1.0) == b"one"
    assert limit.in_flight == 0


# ---------------------------------------------------------------------------------------------
# MetricsLayer


async def test_metrics_counts_hits_misses_and_bytes() -> None:
    stats = TierStats("t")
    metrics = MetricsLayer(await make_backend(), stats)
    await metrics.put("a", b"abc")
    await metrics.put("b", [b"ab", memoryview(b"cde")])
    await metrics.put_many([("c", b"1"), ("d", [b"23", b"4"])])
    assert (stats.puts, stats.bytes_written) == (4, 3 + 5 + 1 + 3)

    assert await metrics.get("a") == b"abc"
    assert await metrics.get("missing") is None
    got = await metrics.get_into("b", alloc)
    assert got is not None
    assert bytes(got) == b"abcde"
    assert await metrics.get_into("missing", alloc) is None
    assert await metrics.get_many(["k1", "missing", "k3"]) == [b"one", None, b"three"]
    assert (stats.hits, stats.misses) == (4, 3)
    assert stats.bytes_read == 3 + 5 + 3 + 5

    assert await metrics.exists("a")
    assert stats.latency["get"].n == 2
    assert stats.latency["get_into"].n == 2
    assert stats.latency["put"].n == 2
    assert stats.latency["exists"].n == 1
    assert stats.errors == {}


async def test_metrics_counts_errors_by_kind() -> None:
    stats = TierStats("t")
    errors = [CorruptObject(), ValueError("bug"), OSError("reset"), Timeout()]
    chaos = ChaosLayer(Flaky(await make_backend(), errors))
    metrics = MetricsLayer(chaos, stats)
    for error in errors:
        with pytest.raises(type(error)):
            await metrics.get("k1")
    chaos.down = True
    with pytest.raises(Unavailable):
        await metrics.put("k1", b"x")
    assert stats.errors == {"corrupt": 1, "internal": 2, "timeout": 1, "unavailable": 1}
    assert (stats.hits, stats.misses, stats.puts, stats.bytes_written) == (0, 0, 0, 0)
    assert stats.corrupt == 0  # the store counts corrupt objects, not this layer
    assert stats.latency["get"].n == 4
    assert stats.latency["put"].n == 1


# ---------------------------------------------------------------------------------------------
# ChaosLayer


async def test_chaos_down_fails_every_call_without_touching_the_connector() -> None:
    counter = Flaky(await make_backend())
    chaos = ChaosLayer(counter, down=True)
    for method in ("get", "put", "exists", "delete", "get_many", "ping", "list"):
        with pytest.raises(Unavailable, match="chaos: backend down"):
            await invoke(chaos, method, ARGS[method])
    assert counter.calls == 0
    chaos.down = False
    assert await chaos.get("k1") == b"one"
    await chaos.close()


async def test_chaos_fail_rate_is_seeded() -> None:
    async def pattern(seed: int) -> list[bool]:
        chaos = ChaosLayer(await make_backend(), fail_rate=0.5, seed=seed)
        outcome = []
        for _ in range(40):
            try:
                await chaos.exists("k1")
                outcome.append(True)
            except Unavailable:
                outcome.append(False)
        return outcome

    first = await pattern(1)
    assert first == await pattern(1)
    assert 5 < first.count(False) < 35

    always = ChaosLayer(await make_backend(), fail_rate=1.0)
    with pytest.raises(Unavailable, match="injected"):
        await always.get("k1")
    assert always.injected == 1


async def test_chaos_adds_latency() -> None:
    chaos = ChaosLayer(await make_backend(), latency=0.03)
    start = time.monotonic()
    assert await chaos.get("k1") == b"one"
    assert time.monotonic() - start >= 0.03


def test_chaos_rejects_bad_options() -> None:
    with pytest.raises(ConfigError):
        ChaosLayer(MemoryConnector(), fail_rate=1.5)
    with pytest.raises(ConfigError):
        ChaosLayer(MemoryConnector(), latency=-1)


# ---------------------------------------------------------------------------------------------
# build_stack and find_layer


def layer_types(stack: Connector) -> list[type]:
    types: list[type] = [type(stack)]
    while isinstance(stack, Layer):
        stack = stack.inner
        types.append(type(stack))
    return types


async def test_build_stack_order() -> None:
    backend = await make_backend()
    stack = build_stack(
        backend,
        timeout=1.0,
        retry=(3, 0.01, 0.1),
        breaker=(5, 1.0),
        concurrency=4,
        stats=TierStats("t"),
        chaos={"latency": 0.0},
    )
    assert layer_types(stack) == [
        MetricsLayer,
        CircuitBreakerLayer,
        TimeoutLayer,
        RetryLayer,
        LimitLayer,
        ChaosLayer,
        MemoryConnector,
    ]
    assert "TimeoutLayer(1s)" in repr(stack)


async def test_build_stack_omits_what_is_not_configured() -> None:
    backend = await make_backend()
    assert build_stack(backend) is backend
    stack = build_stack(backend, timeout=1.0, retry=(1, 0.1, 1.0), breaker=(0, 1.0))
    assert layer_types(stack) == [TimeoutLayer, MemoryConnector]


def test_build_stack_rejects_unknown_chaos_options() -> None:
    with pytest.raises(ConfigError, match="chaos"):
        build_stack(MemoryConnector(), chaos={"fail_rat": 0.5})


async def test_find_layer() -> None:
    stats = TierStats("t")
    stack = build_stack(await make_backend(), timeout=1.0, concurrency=2, stats=stats)
    metrics = find_layer(stack, MetricsLayer)
    assert metrics is stack
    assert metrics.stats is stats
    limit = find_layer(stack, LimitLayer)
    assert limit is not None
    assert limit.max_concurrency == 2
    assert find_layer(stack, CircuitBreakerLayer) is None
    assert find_layer(stack, Layer) is stack
    assert find_layer(MemoryConnector(), Layer) is None


async def test_stack_timeout_bounds_the_retries_and_the_breaker_counts_one_failure() -> None:
    stats = TierStats("t")
    stack = build_stack(
        await make_backend(),
        timeout=0.1,
        retry=(1000, 0.01, 0.01),
        breaker=(2, 10.0),
        stats=stats,
        chaos=ChaosOptions(down=True),
    )
    start = time.monotonic()
    with pytest.raises(Timeout):
        await stack.get("k1")
    assert time.monotonic() - start < 3.0  # well under the 5 s (or 10 s) it would take
    breaker = find_layer(stack, CircuitBreakerLayer)
    assert breaker is not None
    assert breaker.state == "closed"  # one whole call failed, however many attempts it made
    assert stats.errors == {"timeout": 1}

    with pytest.raises(Timeout):
        await stack.get("k1")
    assert breaker.state == "open"
    with pytest.raises(CircuitOpen):
        await stack.get("k1")
    assert stats.errors == {"timeout": 2, "circuit_open": 1}


async def test_stack_queueing_for_a_permit_counts_against_the_timeout() -> None:
    # Each call takes 0.1 s, well within the 0.5 s timeout alone (slack for a loaded machine);
    # the sixth and later in the queue are not.
    stack = build_stack(
        await make_backend(), timeout=0.5, concurrency=1, chaos=ChaosOptions(latency=0.1)
    )
    results = await asyncio.gather(*(stack.get("k1") for _ in range(10)), return_exceptions=True)
    assert results.count(b"one") >= 1
    assert sum(isinstance(r, Timeout) for r in results) >= 1
