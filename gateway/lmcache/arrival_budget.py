"""A bound on the bytes that clients have sent and a server has not stored yet, charged as the
bytes arrive (lm:// payloads).

Why as they arrive, not as declared: a budget reserved for declared lengths lets two headers
that declare the largest object and send nothing hold all of it, so every other upload waits
(a lock-out for as long as the stall timeout, renewed by two more headers). Charged on arrival,
a declaration costs nothing, and what is charged is memory really in use.

A receiver whose bytes push the total over the limit is *parked*: it stops reading (TCP flow
control makes its client wait) until stored payloads give bytes back. If every receiver that
holds bytes is parked, none can finish and give any back; then the one parked first becomes
*exempt*: it reads on past the limit until it gives its bytes back, and no other is let past
meanwhile. So memory stays within ``limit`` plus one payload, and no upload starves.
"""

from __future__ import annotations

from typing import Protocol


class Receiver(Protocol):
    def resume(self) -> None:
        """Start reading again (the budget has room, or lets this one go on regardless)."""
        ...


class ArrivalBudget:
    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError("the budget must be positive")
        self.limit = limit
        self.used = 0
        self._held: dict[Receiver, int] = {}  # bytes each receiver holds
        self._parked: dict[Receiver, None] = {}  # in the order they were parked
        self._exempt: Receiver | None = None  # the one let past the limit (see the module)

    def charge(self, receiver: Receiver, nbytes: int) -> bool:
        """Count ``nbytes`` that arrived for ``receiver``; False when it should park."""
        self.used += nbytes
        self._held[receiver] = self._held.get(receiver, 0) + nbytes
        return self.used <= self.limit or receiver is self._exempt

    def park(self, receiver: Receiver) -> None:
        """``receiver`` stopped reading until ``resume``."""
        self._parked[receiver] = None
        self._unstick()

    def release(self, receiver: Receiver) -> None:
        """``receiver`` gives back all it holds (its payload is stored, or it is gone) and
        stops waiting."""
        self.used -= self._held.pop(receiver, 0)
        self._parked.pop(receiver, None)
        if receiver is self._exempt:
            self._exempt = None
        if self.used < self.limit:
            for waiter in list(self._parked):  # each charges again as its bytes come
                del self._parked[waiter]
                waiter.resume()
        else:
            self._unstick()

    def held(self, receiver: Receiver) -> int:
        return self._held.get(receiver, 0)

    def room(self, receiver: Receiver, least: int) -> int | None:
        """How many bytes ``receiver`` should read at most now: what is left under the limit
        (at least ``least``, so reads stay worth their cost), or None for no bound (the
        exempt one). Reading no more than this keeps the overshoot of each receiver that
        charges past the limit to ``least`` bytes."""
        if receiver is self._exempt:
            return None
        return max(least, self.limit - self.used)

    @property
    def parked(self) -> int:
        return len(self._parked)

    def _unstick(self) -> None:
        if self._exempt is not None or not self._parked:
            return  # one is past the limit already: it will give its bytes back
        if all(r in self._parked for r in self._held):
            first = next(iter(self._parked))
            del self._parked[first]
            self._exempt = first
            first.resume()
