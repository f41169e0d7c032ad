"""``gateway.deadlines``: many calls' deadlines on one timer, with asyncio.timeout's semantics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

from gateway.deadlines import DeadlinePassed, Deadlines

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
