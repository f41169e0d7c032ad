"""RESP, the Redis protocol, as far as the fast path writes and parses it.

Commands are built as scatter lists, so a value of several MiB is never joined into one bytes
object. ``parse_reply`` parses one whole reply of the small kinds (status, error, integer,
bulk, array, nil) from a buffer, or says that more bytes are needed; errors come back as the
redis-py exception objects that redis-py would raise for their codes, so that one map
(``client.redis_error``) turns them into kvgate errors. Large bulk replies never go through it:
the fast path receives those straight into their destination.
"""

from __future__ import annotations

from collections.abc import Sequence

from redis._parsers import BaseParser

from gateway.types import Buffer

_CRLF = b"\r\n"


class Incomplete(Exception):
    """More bytes are needed before the reply can be parsed."""


class ProtocolError(Exception):
    """The peer sent something that is not RESP."""


def command(*args: bytes) -> bytes:
    """One RESP command of small arguments (keys, numbers, names)."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        out.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(out)


def set_command(key: bytes, value: Sequence[memoryview], px: int | None) -> list[Buffer]:
    """``SET key value [PX px]`` as a scatter list; ``value``'s buffers are not copied."""
    extra = [b"PX", b"%d" % px] if px is not None else []
    size = sum(v.nbytes for v in value)
    head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (3 + len(extra), len(key), key, size)
    tail = b"\r\n" + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in extra)
    return [head, *value, tail]


def parse_reply(buf: bytearray, pos: int) -> tuple[object, int]:
    """The reply at ``buf[pos:]`` and where it ends; nil is None, errors are exception
    objects. Raises _Incomplete when ``buf`` does not hold all of it yet."""
    end = buf.find(_CRLF, pos)
    if end < 0:
        raise Incomplete
    kind, line, after = buf[pos : pos + 1], bytes(buf[pos + 1 : end]), end + 2
    try:
        if kind == b"+":
            return line, after
        if kind == b"-":  # redis-py's class for the code (LOADING, MOVED, OOM, NOAUTH, ...)
            error = BaseParser.parse_error(line.decode(errors="replace"))  # type: ignore[no-untyped-call]
            return error, after
        if kind == b":":
            return int(line), after
        if kind == b"$":
            length = int(line)
            if length < 0:
                return None, after
            if len(buf) < after + length + 2:
                raise Incomplete
            if buf[after + length : after + length + 2] != _CRLF:
                raise ProtocolError("a bulk reply not ended by CRLF")
            return bytes(buf[after : after + length]), after + length + 2
        if kind == b"*":
            count = int(line)
            if count < 0:
                return None, after
            items = []
            for _ in range(count):
                item, after = parse_reply(buf, after)
                items.append(item)
            return items, after
    except ValueError:
        raise ProtocolError(f"bad number in {bytes(kind + line[:40])!r}") from None
    raise ProtocolError(f"unknown reply type {bytes(kind)!r}")
