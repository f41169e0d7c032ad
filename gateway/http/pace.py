"""Request bodies must keep arriving: one that stalls, or trickles, fails with 408.

Without this, a client that declares a large ``Content-Length`` and sends nothing holds its
share of the body budget (``ByteBudget``) and its body buffer for as long as it keeps the
connection open: two such uploads lock every other upload out. Two limits apply while the app
waits for the next piece of a body:

- ``idle``: seconds without a piece arriving;
- ``min_rate``: bytes per second the body must average, counted from ``idle`` seconds after
  the app first asked for it (0: no rate limit). Without it, a client sending a byte now and
  then would dodge the idle limit and hold a reservation for hours.

So a body holds the budget for at most ``idle + declared / min_rate`` seconds. The clock starts
when the app first asks for the body, not when the request arrives: a request that waited for
the budget is not charged for the wait. The 408 answer closes the connection (the rest of the
body would otherwise be read as the next request).
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import GatewayError

DEFAULT_BODY_TIMEOUT = 20.0  # below ByteBudget's default wait (30 s): a waiter outlives a stall
DEFAULT_BODY_MIN_RATE = 1 << 20


class BodyTimeout(GatewayError):
    """The request body stopped arriving, or arrives slower than the server accepts."""

    kind = "body_timeout"
    retryable = True


class BodyPace:
    """ASGI middleware: every request body keeps to ``idle`` and ``min_rate`` (see above)."""

    def __init__(self, app: ASGIApp, idle: float, min_rate: int) -> None:
        if not idle > 0 or min_rate < 0:
            raise ValueError("the body timeout must be > 0 and the minimum rate >= 0")
        self.app = app
        self.idle = idle
        self.min_rate = min_rate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.app(scope, _PacedReceive(receive, self.idle, self.min_rate), send)


class _PacedReceive:
    """``receive`` with the limits. One timer per request, moved lazily: a piece that arrives
    only moves the deadline, and the timer, when it fires early, re-arms itself at the latest
    deadline (an ``asyncio.timeout`` per piece cost ~10 us, 40 ms per GiB of body)."""

    __slots__ = (
        "_cancelling",
        "_deadline",
        "_expired",
        "_receive",
        "_slow",
        "_timer",
        "_waiter",
        "done",
        "idle",
        "min_rate",
        "received",
        "start",
    )

    def __init__(self, receive: Receive, idle: float, min_rate: int) -> None:
        self._receive = receive
        self.idle = idle
        self.min_rate = min_rate
        self.start: float | None = None
        self.received = 0
        self.done = False  # the whole body arrived (or the client left): no limit after it
        self._deadline = 0.0
        self._slow = False  # the deadline is the rate's, not the idle one
        self._timer: asyncio.TimerHandle | None = None
        self._waiter: asyncio.Task[Any] | None = None  # the task waiting in receive, if any
        self._cancelling = 0
        self._expired = False

    async def __call__(self) -> Message:
        if self.done:
            return await self._receive()
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self.start is None:
            self.start = now
        self._deadline, self._slow = now + self.idle, False
        if self.min_rate:
            behind = self.start + self.idle + self.received / self.min_rate
            if behind < self._deadline:
                self._deadline, self._slow = behind, True
        if now >= self._deadline:
            raise BodyTimeout(self._why())
        if self._timer is None or self._timer.when() > self._deadline:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_at(self._deadline, self._fire)
        task = asyncio.current_task()
        assert task is not None
        self._waiter, self._cancelling = task, task.cancelling()
        try:
            message = await self._receive()
        except asyncio.CancelledError:
            # Ours only if the timer cancelled, and no one else did too (as asyncio.timeout).
            if self._expired and task.uncancel() <= self._cancelling:
                raise BodyTimeout(self._why()) from None
            raise
        finally:
            self._waiter = None
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            self.done = not message.get("more_body", False)
        else:
            self.done = True
        if self.done and self._timer is not None:
            self._timer.cancel()
            self._timer = None
        return message

    def _fire(self) -> None:
        self._timer = None
        if self._waiter is None:
            return  # the app is busy between pieces: its next receive re-arms the timer
        loop = asyncio.get_running_loop()
        if loop.time() < self._deadline:  # pieces arrived since it was set: not due yet
            self._timer = loop.call_at(self._deadline, self._fire)
            return
        self._expired = True
        self._waiter.cancel()

    def _why(self) -> str:
        if self._slow:
            return (
                f"request body too slow: {self.received} bytes arrived, and the server needs "
                f"{self.min_rate} bytes/s once {self.idle:g} s have passed"
            )
        return f"request body stalled: nothing arrived for {self.idle:g} s"
