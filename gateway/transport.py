"""The stream transport that an asyncio protocol is handed, whatever the event loop.

``kvgate serve`` runs on uvloop, whose TCP and Unix transports implement every method of
``asyncio.Transport`` but do not inherit from it: an ``isinstance`` check refuses them (it
reset every lm:// connection and every Redis fast-path connection under uvloop). Protocols ask
for the methods they use instead, once, when the connection is made.
"""

from __future__ import annotations

import asyncio
from typing import cast

# What kvgate's protocols call on a stream transport.
STREAM_METHODS = (
    "write",
    "writelines",
    "is_closing",
    "close",
    "abort",
    "pause_reading",
    "resume_reading",
    "set_write_buffer_limits",
    "get_write_buffer_size",
    "get_extra_info",
)


def stream_transport(transport: asyncio.BaseTransport) -> asyncio.Transport:
    """``transport`` as an ``asyncio.Transport``, checked by the methods it has.

    Raises ``TypeError`` for a transport that cannot carry a byte stream (a datagram or pipe
    transport handed to a stream protocol by mistake).
    """
    if isinstance(transport, asyncio.Transport):
        return transport
    missing = [m for m in STREAM_METHODS if not callable(getattr(transport, m, None))]
    if missing:
        raise TypeError(f"{type(transport).__name__} is not a stream transport: no {missing}")
    return cast(asyncio.Transport, transport)
