"""``gateway.deadlines``: many calls' deadlines on one timer, with asyncio.timeout's semantics."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

from connectors.memory import MemoryConnector
from gateway.deadlines import DeadlinePassed, Deadlines
from gateway.errors import Timeout
from gateway.layers import TimeoutLayer
from gateway.types import Buffer

try:
    import uvloop
except ImportError:  # pragma: no cover - the serve extra is not installed
    uvloop = None  # type: ignore[assignment]

pytestmark = pytest.mark.both_loops  # `kvgate serve` runs on uvloop, whose timers differ

T = TypeVar("T")


async def run(deadlines: Deadlines, call: Callable[[], Awaitable[T]]) -> T:
    with deadlines.start():
        return await call()


async def test_a_call_in_time_returns_its_result() -> None:
    deadlines = Deadlines(1.0)

    async def quick() -> int:
        await asyncio.sleep(0)
        return 7

    assert await run(deadlines, quick) == 7
    task = asyncio.current_task()
    assert task is not None
    assert task.cancelling() == 0


async def test_a_slow_call_fails_at_its_deadline_and_leaves_the_task_uncancelled() -> None:
    deadlines = Deadlines(0.05)
    start = time.monotonic()
    with pytest.raises(DeadlinePassed):
        await run(deadlines, lambda: asyncio.sleep(5))
    assert 0.04 <= time.monotonic() - start < 1.0
    task = asyncio.current_task()
    assert task is not None
    assert task.cancelling() == 0
    await asyncio.sleep(0.01)  # no cancellation left pending for the next await


async def test_each_call_gets_its_own_deadline() -> None:
    """Calls started at different times, some slow: only the slow ones fail, each about its
    own deadline after it started, not when an earlier call's timer fires."""
    deadlines = Deadlines(0.2)
    outcome: dict[str, float | str] = {}

    async def one(name: str, delay: float, takes: float) -> None:
        await asyncio.sleep(delay)
        start = time.monotonic()
        try:
            await run(deadlines, lambda: asyncio.sleep(takes))
            outcome[name] = "done"
        except DeadlinePassed:
            outcome[name] = time.monotonic() - start

    await asyncio.gather(
        one("fast-early", 0.0, 0.01),
        one("slow-early", 0.0, 5.0),
        one("fast-late", 0.1, 0.05),
        one("slow-late", 0.15, 5.0),
    )
    assert outcome["fast-early"] == "done"
    assert outcome["fast-late"] == "done"
    for name in ("slow-early", "slow-late"):
        waited = outcome[name]
        assert isinstance(waited, float)
        assert 0.19 <= waited < 0.6, (name, waited)


async def test_someone_elses_cancel_is_not_a_timeout() -> None:
    deadlines = Deadlines(5.0)
    task = asyncio.create_task(run(deadlines, lambda: asyncio.sleep(5)))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_timeout_error_of_the_call_itself_is_not_a_deadline() -> None:
    deadlines = Deadlines(5.0)

    async def socket_timeout() -> None:
        raise TimeoutError("the socket's own")

    with pytest.raises(TimeoutError, match="the socket's own") as caught:
        await run(deadlines, socket_timeout)
    assert not isinstance(caught.value, DeadlinePassed)


async def test_a_call_that_swallows_the_cancellation_keeps_its_result() -> None:
    deadlines = Deadlines(0.02)

    async def stubborn() -> str:
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            return "kept"
        return "slept"

    assert await run(deadlines, stubborn) == "kept"
    task = asyncio.current_task()
    assert task is not None
    assert task.cancelling() == 0
    await asyncio.sleep(0.01)


async def test_a_shorter_deadline_set_later_is_not_late() -> None:
    deadlines = Deadlines(10.0)
    long_call = asyncio.create_task(run(deadlines, lambda: asyncio.sleep(0.5)))
    await asyncio.sleep(0.01)
    deadlines.seconds = 0.05
    start = time.monotonic()
    with pytest.raises(DeadlinePassed):
        await run(deadlines, lambda: asyncio.sleep(5))
    assert time.monotonic() - start < 0.4
    await long_call  # its own 10 s deadline still holds


async def test_extending_a_deadline_keeps_a_progressing_block_alive() -> None:
    deadlines = Deadlines(0.1)
    start = time.monotonic()
    with deadlines.start() as deadline:
        for _ in range(6):  # 0.3 s in all, never 0.1 s without progress
            await asyncio.sleep(0.05)
            deadline.extend()
    assert time.monotonic() - start >= 0.3

    async def stalls_after_progress() -> None:
        with deadlines.start() as deadline:
            await asyncio.sleep(0.05)
            deadline.extend()
            await asyncio.sleep(5)

    with pytest.raises(DeadlinePassed):
        await stalls_after_progress()


async def test_thousands_of_staggered_blocks_all_time_out() -> None:
    """Batches of blocks a millisecond apart: the timer re-arms for deadlines due within a
    millisecond, for which uvloop's call_at returns a plain Handle (no ``when()``)."""
    deadlines = Deadlines(0.2)
    outcomes: Counter[str] = Counter()

    async def one() -> None:
        try:
            with deadlines.start():
                await asyncio.sleep(5)
            outcomes["done"] += 1
        except DeadlinePassed:
            outcomes["deadline"] += 1

    tasks = []
    for _ in range(200):
        tasks += [asyncio.create_task(one()) for _ in range(100)]
        await asyncio.sleep(0.001)
    await asyncio.gather(*tasks)
    assert outcomes == {"deadline": 20000}


async def test_deadlines_shorter_than_a_millisecond() -> None:
    deadlines = Deadlines(0.0004)
    for outcome in await asyncio.gather(
        *(run(deadlines, lambda: asyncio.sleep(0.05)) for _ in range(3)), return_exceptions=True
    ):
        assert isinstance(outcome, DeadlinePassed)


async def test_a_deadline_is_entered_once() -> None:
    deadline = Deadlines(1.0).start()
    with deadline:
        await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="entered once"), deadline:
        pass


async def test_the_timeout_layer_owns_a_timeout_error_raised_after_its_deadline() -> None:
    """A connector that turns the deadline's cancellation into a TimeoutError of its own still
    gives the caller the layer's Timeout; one raised before the deadline stays as it is."""

    class Converting(MemoryConnector):
        async def get(self, key: str) -> Buffer | None:
            try:
                await asyncio.sleep(5)
            except asyncio.CancelledError:
                raise TimeoutError("the connector's own") from None
            return None

    with pytest.raises(Timeout, match="did not finish within"):
        await TimeoutLayer(Converting(), 0.05).get("k")


def test_one_deadlines_serves_loop_after_loop() -> None:
    """Tests run one loop each, and a connector may outlive one: a timer armed on a closed
    loop, or a block that loop left open, must not stop the next loop's deadlines."""
    deadlines = Deadlines(0.1)

    async def quick() -> None:
        with deadlines.start():
            await asyncio.sleep(0)

    async def left_open() -> None:
        async def hang() -> None:
            with deadlines.start():
                await asyncio.sleep(5)

        asyncio.get_running_loop().create_task(hang())
        await asyncio.sleep(0.01)  # the loop closes with that block still open

    async def slow() -> float:
        start = time.monotonic()
        with pytest.raises(DeadlinePassed):
            await asyncio.gather(*(run(deadlines, lambda: asyncio.sleep(5)) for _ in range(3)))
        return time.monotonic() - start

    runners = [asyncio.run] + ([uvloop.run] if uvloop is not None else [])
    for runner in runners:
        runner(quick())
        runner(left_open())
        assert runner(slow()) < 1.0
