"""A bound on the bytes that request bodies hold at once, across all requests.

``--max-body`` bounds one body; without this, 64 concurrent uploads of 1 GiB would hold 64 GiB.
A request whose body would push the total over the budget waits for others to finish, up to
``wait`` seconds, then is refused as ``Unavailable`` (503): the server sheds load instead of
growing. One body may always use the whole budget on its own, so no body that ``max_body``
allows can wait forever.
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

    async def acquire(self, nbytes: int) -> int:
        """Reserve ``nbytes`` (capped at the budget); returns what to ``release`` later."""
        n = min(nbytes, self.limit)
        try:
            async with asyncio.timeout(self.wait):
                while self.used + n > self.limit:
                    waiter = asyncio.get_running_loop().create_future()
                    self._waiters.append(waiter)
                    await waiter
        except TimeoutError:
            raise Unavailable(
                f"busy: request bodies in flight hold {self.used} of {self.limit} bytes; "
                "retry later"
            ) from None
        self.used += n
        return n

    def release(self, n: int) -> None:
        """Give back what ``acquire`` returned; every waiter rechecks (sync: called from
        ``finally`` blocks)."""
        self.used -= n
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
