"""A bound on the bytes that request bodies hold at once, across all requests.

``--max-body`` bounds one body; without this, 64 concurrent uploads of 1 GiB would hold 64 GiB.
A request whose body would push the total over the budget waits for others to finish, up to
``wait`` seconds, then is refused as ``Unavailable`` (503): the server sheds load instead of
growing. One body may always use the whole budget on its own, so no body that ``max_body``
allows can wait forever.

A request that holds its body may need more beside it: the object a frame decodes to
(``grow``). Such a request waits like a new one, but with two differences, both because it
already holds bytes that only its own progress gives back: the room it waits for is its
before any new body's, and when every byte in use belongs to requests waiting to grow (none
of them can go on, and nothing else will give bytes back), the one that finds this is refused
at once instead of all of them waiting out ``wait``.
"""

from __future__ import annotations

import asyncio
from collections import deque

from gateway.errors import Unavailable


class ByteBudget:
    def __init__(self, limit: int, wait: float = 30.0) -> None:
        if limit <= 0 or wait < 0:
            raise ValueError("the budget and the wait must be positive")
        self.limit = limit
        self.wait = wait
        self.used = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._growers: deque[object] = deque()  # the requests waiting in ``grow``, in order
        self._growers_hold = 0  # what the requests waiting in ``grow`` hold already
        self._growers_want = 0  # and what they wait for

    async def acquire(self, nbytes: int) -> int:
        """Reserve ``nbytes`` (capped at the budget); returns what to ``release`` later."""
        n = min(nbytes, self.limit)
        try:
            async with asyncio.timeout(self.wait):
                while self.used + self._growers_want + n > self.limit:
                    await self._wait()
        except TimeoutError:
            raise self._busy() from None
        self.used += n
        return n

    async def grow(self, nbytes: int, held: int) -> int:
        """Reserve ``nbytes`` more for a request that holds ``held`` already (capped so that
        the two fit the budget: alone, the request always can); returns what to ``release``.

        Requests that wait to grow are served in arrival order: one that grows again and again
        (a batch, entry after entry) queues behind those already waiting, instead of taking
        back at once the room it has just given."""
        n = max(0, min(nbytes, self.limit - held))
        if not self._growers and self.used + n <= self.limit:
            self.used += n
            return n
        me = object()
        self._growers.append(me)
        self._growers_hold += held
        self._growers_want += n
        self._wake()  # what waiting requests hold changed: the first in line looks again
        try:
            async with asyncio.timeout(self.wait):
                while self._growers[0] is not me or self.used + n > self.limit:
                    if self._growers[0] is me and self.used <= self._growers_hold:
                        # First in line, and every byte in use is held by requests waiting
                        # here: none can go on, so this one gives way (its failure frees them).
                        raise Unavailable(
                            f"busy: every request holding some of the {self.limit} bytes for "
                            "request bodies waits for more; this one gives way: retry later"
                        )
                    await self._wait()
        except TimeoutError:
            raise self._busy() from None
        finally:
            self._growers.remove(me)
            self._growers_hold -= held
            self._growers_want -= n
            self._wake()  # the next in line, and new bodies that waited for this room
        self.used += n
        return n

    def release(self, n: int) -> None:
        """Give back what ``acquire`` or ``grow`` returned; every waiter rechecks (sync:
        called from ``finally`` blocks)."""
        self.used -= n
        self._wake()

    async def _wait(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        await waiter

    def _wake(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    def _busy(self) -> Unavailable:
        return Unavailable(
            f"busy: request bodies in flight hold {self.used} of {self.limit} bytes; retry later"
        )
