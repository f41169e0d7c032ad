"""Deadlines for many calls on one timer: what ``asyncio.timeout`` does, at a fraction of its cost.

``asyncio.timeout`` arms a timer per block (a ``TimerHandle`` pushed on the loop's heap and
cancelled again) and enters and leaves through two coroutines: about 4.5 us per call here, the
largest single cost in the layers every tier call goes through (a put of a small object spent
about 35 us in kvgate's own code). ``Deadlines`` keeps its blocks' deadlines in a set and one
timer for the earliest of them, so a block that ends in time costs a set insert and remove::

    deadlines = Deadlines(5.0)            # one per layer or client
    with deadlines.start() as deadline:   # a plain (synchronous) ``with``, around awaits
        await send()
        deadline.extend()                 # progress: ``seconds`` from now again
        await receive()

The semantics are ``asyncio.timeout``'s: when a deadline passes, the task is cancelled, and
the block raises ``DeadlinePassed`` (a ``TimeoutError``) in place of that cancellation, unless
someone else also cancelled the task meanwhile (then the ``CancelledError`` goes on, as it
must). A block that swallows the cancellation and ends normally keeps its result. A block runs
inside a task, ends in the task that started it, and is entered once.

The timer is armed on the loop of the block that needs it; a ``Deadlines`` used from another
loop later (tests run one loop each) arms a new one there, and blocks left open by a loop that
has gone are dropped, never cancelled.
"""

from __future__ import annotations

import asyncio
from typing import Any

_EARLY = 1e-3  # deadlines this close together expire in one pass: the loop's clock granularity


class DeadlinePassed(TimeoutError):
    """A block's deadline passed (a TimeoutError raised inside the block is not one)."""


class Deadline:
    """One block's deadline (``Deadlines.start``)."""

    __slots__ = ("_cancelling", "_entered", "_owner", "_task", "expired", "when")

    def __init__(self, owner: Deadlines) -> None:
        self._owner = owner
        self._task: asyncio.Task[Any] | None = None
        self._entered = False
        self._cancelling = 0
        self.when = 0.0
        self.expired = False

    def __enter__(self) -> Deadline:
        if self._entered:
            raise RuntimeError("a Deadline is entered once: start() another")
        task = asyncio.current_task()
        if task is None:  # asyncio.timeout refuses this too: there is no task to cancel
            raise RuntimeError("a deadline needs to run inside an asyncio task")
        self._entered = True
        self._task = task
        self._cancelling = task.cancelling()
        self.when = task.get_loop().time() + self._owner.seconds
        self._owner._add(self, task.get_loop())
        return self

    def extend(self) -> None:
        """The block made progress: its deadline is ``seconds`` from now again."""
        task = self._task
        if not self.expired and task is not None:
            self.when = task.get_loop().time() + self._owner.seconds
            self._owner._arm(self.when, task.get_loop())  # earlier only if seconds shrank

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, _: Any
    ) -> None:
        task = self._task
        self._task = None
        if not self.expired:
            self._owner._live.discard(self)
            return
        assert task is not None
        cancelled = exc_type is not None and issubclass(exc_type, asyncio.CancelledError)
        if task.uncancel() <= self._cancelling and cancelled:
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
        # The armed timer, when it fires and on which loop. Its time is kept here rather than
        # read back with ``when()``: uvloop returns a plain Handle, which has none, for a
        # delay it rounds to 0 ms.
        self._timer: asyncio.Handle | None = None
        self._timer_at = 0.0
        self._timer_loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> Deadline:
        """A deadline ``seconds`` from when its ``with`` block is entered."""
        return Deadline(self)

    def _add(self, deadline: Deadline, loop: asyncio.AbstractEventLoop) -> None:
        self._arm(deadline.when, loop)  # first: if it raises, the block was never live
        self._live.add(deadline)

    def _arm(self, when: float, loop: asyncio.AbstractEventLoop) -> None:
        """Make sure the timer fires by ``when`` on ``loop``."""
        if self._timer is not None and self._timer_loop is loop and self._timer_at <= when:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_at(when, self._expire)
        self._timer_at = when
        self._timer_loop = loop

    def _expire(self) -> None:
        """Cancel the blocks whose deadline passed; arm the timer for the next one.

        It looks at every live block: as many as the owner has calls in flight. While calls
        end in time it runs about once per ``seconds``; against a backend that stalls, once
        per group of deadlines within ``_EARLY`` of each other.
        """
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time() + _EARLY
        try:
            for deadline in list(self._live):
                task = deadline._task
                if task is None or task.done() or task.get_loop() is not loop:
                    self._live.discard(deadline)  # left open by a loop that is gone
                elif deadline.when <= now:
                    self._live.discard(deadline)
                    deadline._expire()
        finally:  # whatever happened, the blocks still live keep a timer
            if self._live:
                self._arm(min(d.when for d in self._live), loop)
