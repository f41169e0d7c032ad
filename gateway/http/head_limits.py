"""A request's head (request line and headers) must arrive within a bound of time and within
a bound of size, or the connection is closed: uvicorn has no time limit, and no size limit
under httptools (what ``kvgate serve`` runs, the serve extra installs it).

Time. uvicorn's ``timeout_keep_alive`` runs only between requests and stops at the first byte
of the next one, and nothing runs on a fresh connection, so a client that sends nothing, or a
header byte every few seconds, holds its connection (a file descriptor, buffers) for ever;
a few thousand such clients exhaust the server (slowloris). Request bodies have their limits
in ``pace``; this module bounds what comes before them, under either protocol class uvicorn
may pick: httptools or h11.

The clock starts when a connection opens (a client that sends nothing is closed too) and,
on a keep-alive connection, at the first byte of each later request (the idle time between
requests stays uvicorn's keep-alive timeout's). It stops when the head is complete. While
the server still answers an earlier request it may not be reading (pipelining), so the bound
is not enforced then, and starts again when that answer is complete. When it passes, a client
that sent part of a head gets a 408 first; a connection that sent nothing is just closed, as
uvicorn closes an idle keep-alive connection. One ``call_later`` timer per connection, never a
task.

Size. Under httptools uvicorn keeps every header the parser reports and every piece of the
URL, and httptools joins a header's pieces until the next header starts, so a client that
streams headers (or one endless header) faster than the clock runs grows the server by all it
sends: 1.8 GiB in 3 s. Here a message's URL and header lines (``name: value`` and the line
end, as sent; a chunked body's trailers too) are counted as the parser reports them, and the
one that would pass ``max_bytes`` stops the parser before uvicorn keeps it (uvicorn logs its
"Invalid HTTP request received."); what the parser holds unreported is at most what was fed
since it last reported anything, counted too. A connection so holds at most ``max_bytes`` and
two socket reads of a head. Past the bound a client sending a head, with no answer under way,
gets a 431 ``header_too_large``; otherwise (trailers, a pipelined head) the connection is just
closed. Under h11 the bound is h11's ``max_incomplete_event_size``, set to the same number: h11
refuses once what it holds of an incomplete head (the request line included) passes it, and
uvicorn's 400 for that becomes the same 431; h11 checks only what is incomplete, so a head
that arrives whole in one socket read is served even if larger.

The protocol classes are small subclasses of uvicorn's (``head_limits_protocol``).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from uvicorn.config import Config
    from uvicorn.server import ServerState

log = logging.getLogger("kvgate.service")

DEFAULT_HEADER_TIMEOUT = 10.0  # a head is a few hundred bytes, usually sent in one piece
# kvgate's own clients send a few KiB at most (a 1 KiB key percent-encoded in the URL, the
# token, a codec's options); the largest head the API asks for is a batch put's positions,
# 1024 entries of up to 18 digits: under 20 KiB.
DEFAULT_MAX_HEADER_BYTES = 64 << 10


def _answer(status: bytes, kind: str, detail: str) -> bytes:
    """A whole response in kvgate's error shape, that closes the connection."""
    body = json.dumps({"error": kind, "detail": detail}).encode()
    return (
        b"HTTP/1.1 %s\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (status, len(body), body)
    )


_TIMED_OUT = _answer(
    b"408 Request Timeout", "header_timeout", "the request head did not arrive in time"
)


class _HeadTooLarge(Exception):
    """Raised in a parser callback: httptools stops there, uvicorn calls send_400_response."""


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


def _close(transport: asyncio.Transport, why: str, answer: bytes | None) -> None:
    if transport.is_closing():
        return
    log.debug("closing %s: %s", transport.get_extra_info("peername"), why)
    if answer is not None:  # no response is under way: tell the client why
        transport.write(answer)
    transport.close()


class _HeadClock(asyncio.Protocol):
    """What both protocol classes do alike: a connection's head clock, started when it opens
    and stopped when it closes; when it runs out, the connection is closed (with a 408 if a
    head has begun), unless an answer is under way (uvicorn reads no next head before it
    completes, and restarts the clock then). First in each class's bases, before uvicorn's."""

    head_seconds: float
    # uvicorn's protocol classes set these (their own annotations are looser or missing).
    loop: Any
    transport: Any
    cycle: Any

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.head_clock = _Clock(self.loop, self.head_seconds, self._head_timed_out)
        self.head_clock.start()

    def connection_lost(self, exc: Exception | None) -> None:
        self.head_clock.stop()
        super().connection_lost(exc)

    def _head_begun(self) -> bool:
        """Whether part of a request's head has arrived (the 408 is then owed)."""
        raise NotImplementedError

    def _head_timed_out(self) -> None:
        if self.cycle is not None and not self.cycle.response_complete:
            return  # still answering: the clock starts again when the answer completes
        _close(
            self.transport,
            f"no complete request head within {self.head_seconds:g} s",
            _TIMED_OUT if self._head_begun() else None,
        )


def head_limits_protocol(
    seconds: float = DEFAULT_HEADER_TIMEOUT,
    http: Literal["auto", "httptools", "h11"] = "auto",
    *,
    max_bytes: int = DEFAULT_MAX_HEADER_BYTES,
) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class ``http`` (``auto``: httptools when installed, else h11,
    as uvicorn picks) with a request head bound to ``seconds`` and ``max_bytes``; pass it as
    ``uvicorn.run(http=...)`` (under h11 it replaces ``h11_max_incomplete_event_size``)."""
    if not seconds > 0:
        raise ValueError("the header timeout must be > 0")
    if not max_bytes > 0:
        raise ValueError("the header size bound must be > 0")
    if http == "auto":
        http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    too_large = _answer(
        b"431 Request Header Fields Too Large",
        "header_too_large",
        f"the request's URL and headers pass {max_bytes} bytes",
    )
    if http == "httptools":
        return _httptools(seconds, max_bytes, too_large)
    return _h11(seconds, max_bytes, too_large)


def _httptools(seconds: float, max_bytes: int, too_large: bytes) -> type[asyncio.Protocol]:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HttpToolsHeadLimits(_HeadClock, HttpToolsProtocol):
        head_seconds = seconds
        # The parser calls on_message_begin at a request's first byte and on_headers_complete
        # at the end of its head; on_response_complete is where uvicorn resumes reading.
        # It reports the URL piece by piece (on_url) but a header only once the next one
        # starts (on_header), holding its pieces until then.
        in_head = False  # between a request's first byte and the end of its head
        head_bytes = 0  # of this message's URL and header lines reported so far
        unreported = 0  # bytes fed since the parser last called back (before this read)
        called_back = False  # during this read
        too_large = False

        def data_received(self, data: bytes) -> None:
            self.called_back = False
            super().data_received(data)
            if self.called_back:  # the parser holds at most the rest of this read
                self.unreported = 0
                return
            # No callback: the parser is inside a header (a body calls back), holding it all.
            self.unreported += len(data)
            if self.head_bytes + self.unreported > max_bytes:
                self._refuse()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.called_back = self.in_head = True
            self.head_bytes = 0
            self.head_clock.start()

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value) + 4)  # as sent: "name: value\r\n"
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self.called_back = True
            self.in_head = False
            self.head_clock.stop()
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            self.called_back = True
            super().on_body(body)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.in_head and not self.transport.is_closing():
                self.head_clock.start()

        def send_400_response(self, msg: str) -> None:
            if self.too_large:  # our _HeadTooLarge stopped the parser
                self._refuse()
            else:
                super().send_400_response(msg)

        def _count(self, size: int) -> None:
            self.called_back = True
            self.head_bytes += size
            if self.head_bytes > max_bytes:
                self.too_large = True
                raise _HeadTooLarge

        def _refuse(self) -> None:
            self.too_large = True
            answering = self.in_head and (self.cycle is None or self.cycle.response_complete)
            _close(
                self.transport,
                f"request head over {max_bytes} bytes",
                too_large if answering else None,
            )

        def _head_begun(self) -> bool:
            return self.in_head

    return HttpToolsHeadLimits


def _h11(seconds: float, max_bytes: int, too_large: bytes) -> type[asyncio.Protocol]:
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class H11HeadLimits(_HeadClock, H11Protocol):
        head_seconds = seconds

        # h11 waits for a request in state IDLE, holding what it has of its head unparsed,
        # and leaves IDLE once the head is parsed. uvicorn runs h11 in handle_events, on data
        # and when a response completes (where h11 starts the next cycle).
        def __init__(
            self,
            config: Config,
            server_state: ServerState,
            app_state: dict[str, Any],
            _loop: asyncio.AbstractEventLoop | None = None,
        ) -> None:
            super().__init__(config, server_state, app_state, _loop)
            # h11's bound is max_bytes, whatever uvicorn's config says (its conn saw nothing).
            self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=max_bytes)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:
                self.head_clock.stop()
            elif self.conn.trailing_data[0]:
                self.head_clock.start()

        def send_400_response(self, msg: str) -> None:
            # uvicorn answers every error h11 raises with a 400; what h11 holds is over its
            # bound after the error that bound raises (or junk as long: too large too).
            if len(self.conn.trailing_data[0]) <= max_bytes:
                super().send_400_response(msg)
                return
            reading_head = self.conn.our_state is h11.IDLE  # no response begun, none to come
            _close(
                self.transport,
                f"request head over {max_bytes} bytes",
                too_large if reading_head else None,
            )

        def _head_begun(self) -> bool:
            return bool(self.conn.trailing_data[0])

    return H11HeadLimits
