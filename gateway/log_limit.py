"""Keeping a failure that repeats many times a second from becoming as many log lines.

A tier that is down fails every write; one line per failure hides everything else in the log
(a few seconds of a Redis outage printed ~400). ``RepeatLimiter`` decides which of a run of
events of one kind get a line: the first, then at most one per ``interval`` seconds, and each
line says how many went unlogged since the previous one, so nothing is lost from the count.
"""

from __future__ import annotations

import time
from collections.abc import Callable

REPEAT_INTERVAL = 30.0  # seconds between two lines about the same kind of failure


class RepeatLimiter:
    """Per kind: log the first event, then at most one per ``interval`` seconds."""

    def __init__(
        self, interval: float = REPEAT_INTERVAL, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval = interval
        self._clock = clock
        self._last: dict[str, float] = {}  # when a line about the kind was last allowed
        self._quiet: dict[str, int] = {}  # events of the kind not logged since then

    def admit(self, kind: str) -> int | None:
        """None: do not log this one. Otherwise log it, with the returned number of events of
        the same kind that were not logged since the previous line (0 for the first)."""
        now = self._clock()
        last = self._last.get(kind)
        if last is not None and now - last < self.interval:
            self._quiet[kind] = self._quiet.get(kind, 0) + 1
            return None
        self._last[kind] = now
        return self._quiet.pop(kind, 0)

    def unlogged(self) -> dict[str, int]:
        """Events not logged yet, by kind; counted as reported from now on."""
        quiet, self._quiet = self._quiet, {}
        return quiet
