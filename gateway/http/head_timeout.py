"""A request's head (request line and headers) must arrive within a bound, or the connection
is closed: uvicorn has no such limit.

uvicorn's ``timeout_keep_alive`` runs only between requests and stops at the first byte of
the next one, and nothing runs on a fresh connection, so a client that sends nothing, or a
header byte every few seconds, holds its connection (a file descriptor, buffers) for ever;
a few thousand such clients exhaust the server (slowloris). Request bodies have their limits
in ``pace``; this module bounds what comes before them, under either protocol class uvicorn
may pick: httptools (what ``kvgate serve`` runs, the serve extra installs it) or h11.

The clock starts when a connection opens (a client that sends nothing is closed too) and,
on a keep-alive connection, at the first byte of each later request (the idle time between
requests stays uvicorn's keep-alive timeout's). It stops when the head is complete. While
the server still answers an earlier request it may not be reading (pipelining), so the bound
is not enforced then, and starts again when that answer is complete. When it passes, a client
that sent part of a head gets a 408 first; a connection that sent nothing is just closed, as
uvicorn closes an idle keep-alive connection. One ``call_later`` timer per connection, never a
task; the protocol classes are small subclasses of uvicorn's (``head_timeout_protocol``).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
from collections.abc import Callable
from typing import Literal

log = logging.getLogger("kvgate.service")

DEFAULT_HEADER_TIMEOUT = 10.0  # a head is a few hundred bytes, usually sent in one piece

_ANSWER_BODY = json.dumps(
    {"error": "header_timeout", "detail": "the request head did not arrive in time"}
).encode()
_ANSWER = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(_ANSWER_BODY), _ANSWER_BODY)
)


class _Clock:
    """One connection's deadline for the head it is reading: one timer, started once."""

    __slots__ = ("_expired", "_loop", "_seconds", "_timer")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, seconds: float, expired: Callable[[], None]
    ) -> None:
        self._loop = loop
        self._seconds = seconds
        self._expired = expired
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """Start the clock unless it runs (a deadline is never moved later)."""
        if self._timer is None:
            self._timer = self._loop.call_later(self._seconds, self._fire)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fire(self) -> None:
        self._timer = None
        self._expired()


def _close(transport: asyncio.Transport, seconds: float, *, answer: bool) -> None:
    if transport.is_closing():
        return
    log.debug(
        "closing %s: no complete request head within %g s",
        transport.get_extra_info("peername"),
        seconds,
    )
    if answer:  # the client sent part of a request: tell it why (no response is under way)
        transport.write(_ANSWER)
    transport.close()


def head_timeout_protocol(
    seconds: float = DEFAULT_HEADER_TIMEOUT, http: Literal["auto", "httptools", "h11"] = "auto"
) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class ``http`` (``auto``: httptools when installed, else h11,
    as uvicorn picks) with the head bound ``seconds``; pass it as ``uvicorn.run(http=...)``."""
    if not seconds > 0:
        raise ValueError("the header timeout must be > 0")
    if http == "auto":
        http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    return _httptools(seconds) if http == "httptools" else _h11(seconds)


def _httptools(seconds: float) -> type[asyncio.Protocol]:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HttpToolsHeadTimeout(HttpToolsProtocol):
        # The parser calls on_message_begin at a request's first byte and on_headers_complete
        # at the end of its head; on_response_complete is where uvicorn resumes reading.
        in_head = False  # between a request's first byte and the end of its head

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.head_clock = _Clock(self.loop, seconds, self._head_timed_out)
            self.head_clock.start()

        def connection_lost(self, exc: Exception | None) -> None:
            self.head_clock.stop()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.in_head = True
            self.head_clock.start()

        def on_headers_complete(self) -> None:
            self.in_head = False
            self.head_clock.stop()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.in_head and not self.transport.is_closing():
                self.head_clock.start()

        def _head_timed_out(self) -> None:
            if self.cycle is not None and not self.cycle.response_complete:
                return  # still answering: on_response_complete starts the clock again
            _close(self.transport, seconds, answer=self.in_head)

    return HttpToolsHeadTimeout


def _h11(seconds: float) -> type[asyncio.Protocol]:
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class H11HeadTimeout(H11Protocol):
        # h11 waits for a request in state IDLE, holding what it has of its head unparsed,
        # and leaves IDLE once the head is parsed. uvicorn runs h11 in handle_events, on data
        # and when a response completes (where h11 starts the next cycle).
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.head_clock = _Clock(self.loop, seconds, self._head_timed_out)
            self.head_clock.start()

        def connection_lost(self, exc: Exception | None) -> None:
            self.head_clock.stop()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:
                self.head_clock.stop()
            elif self.conn.trailing_data[0]:
                self.head_clock.start()

        def _head_timed_out(self) -> None:
            if self.cycle is not None and not self.cycle.response_complete:
                return  # h11 does not read the next head before this answer completes
            _close(self.transport, seconds, answer=bool(self.conn.trailing_data[0]))

    return H11HeadTimeout
