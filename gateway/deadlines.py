"""Deadlines for many calls on one timer: what ``asyncio.timeout`` does, at a fraction of its cost.

``asyncio.timeout`` arms a timer per block (a ``TimerHandle`` pushed on the loop's heap and
cancelled again) and enters and leaves through two coroutines: about 4.5 us per call here, the
largest single cost in the layers every tier call goes through (a put of a small object spent
about 35 us in kvgate's own code). ``Deadlines`` keeps its calls' deadlines in a set and one
timer for the earliest of them, so a call that finishes in time costs a set insert and remove::

    deadlines = Deadlines(5.0)            # one per layer or client
    with deadlines.start() as deadline:   # a plain (synchronous) ``with``, around awaits
        await send()
        deadline.extend()                 # progress: ``seconds`` from now again
        await receive()

The semantics are ``asyncio.timeout``'s: when a deadline passes, the task is cancelled, and
the block raises ``DeadlinePassed`` (a ``TimeoutError``) in place of that cancellation, unless
someone else also cancelled the task meanwhile (then the ``CancelledError`` goes on, as it
must). A block that swallows the cancellation and ends normally keeps its result. Blocks must
run inside a task, and end in the task that started them.
"""

from __future__ import annotations

import asyncio
from typing import Any

_EARLY = 1e-3  # a timer may fire this much before a deadline: the loop's clock granularity


class DeadlinePassed(TimeoutError):
    """A block's deadline passed (a TimeoutError raised inside the block is not one)."""


class Deadline:
    """One block's deadline (``Deadlines.start``)."""

    __slots__ = ("_cancelling", "_owner", "_task", "expired", "when")

    def __init__(self, owner: Deadlines) -> None:
        self._owner = owner
        self._task: asyncio.Task[Any] | None = None
        self._cancelling = 0
        self.when = 0.0
        self.expired = False

    def __enter__(self) -> Deadline:
        task = asyncio.current_task()
        if task is None:  # asyncio.timeout refuses this too: there is no task to cancel
            raise RuntimeError("a deadline needs to run inside an asyncio task")
        self._task = task
        self._cancelling = task.cancelling()
        self.when = task.get_loop().time() + self._owner.seconds
        self._owner._add(self)
        return self

    def extend(self) -> None:
        """The block made progress: its deadline is ``seconds`` from now again."""
        if not self.expired and self._task is not None:
            self.when = self._task.get_loop().time() + self._owner.seconds

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, _: Any
    ) -> None:
        task = self._task
        self._task = None
        if not self.expired:
            self._owner._live.discard(self)
            return
        assert task is not None
        if task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            raise DeadlinePassed from exc

    def _expire(self) -> None:
        self.expired = True
        assert self._task is not None
        self._task.cancel()


class Deadlines:
    """Deadlines of ``seconds`` for the blocks of one owner (a layer, a client), on one timer."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._live: set[Deadline] = set()
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> Deadline:
        """A deadline ``seconds`` from when its ``with`` block is entered."""
        return Deadline(self)

    def _add(self, deadline: Deadline) -> None:
        self._live.add(deadline)
        timer = self._timer
        if timer is None or deadline.when < timer.when():
            if timer is not None:
                timer.cancel()
            assert deadline._task is not None
            self._timer = deadline._task.get_loop().call_at(deadline.when, self._expire)

    def _expire(self) -> None:
        """Cancel the blocks whose deadline passed; arm the timer for the next one.

        It looks at every live block: they are as many as the owner has calls in flight, and
        this runs about once per ``seconds`` while calls keep finishing in time (a timer
        armed for a block that has ended finds the next one and re-arms).
        """
        self._timer = None
        if not self._live:
            return
        loop = asyncio.get_running_loop()
        now = loop.time() + _EARLY
        first: float | None = None
        for deadline in list(self._live):
            if deadline.when <= now:
                self._live.discard(deadline)
                deadline._expire()
            elif first is None or deadline.when < first:
                first = deadline.when
        if first is not None:
            self._timer = loop.call_at(first, self._expire)
