"""``PartBackend`` on Redis: the primitives ``gateway.parts.StripedObjects`` builds objects on.

- ``write_parts``: ``SET part value PX pending`` per part, ``stripe_concurrency`` at a time,
  each on its own connection (on a cluster, parts spread over slots and nodes; each is a
  single-key command, never a cross-slot one).
- ``swap`` (the commit): ``MULTI; GETRANGE key 0 MANIFEST_SIZE-1; STRLEN key; SET key value
  [PX ttl]; EXEC``, atomic on the server like ``SET ... GET``, but only a manifest's worth of
  the replaced value comes back: overwriting a 4 MiB inline object does not send it back.
  ``StripedObjects`` only needs to know whether that value was a manifest, and which.
- ``take`` (delete): the same transaction with ``UNLINK``.
- ``set_ttl``: ``PERSIST`` (or ``PEXPIRE``) of every part in one pipeline. Its replies say
  whether every part still existed at commit time: one that vanished (evicted, or written to a
  master that a failover replaced) makes the put fail instead of acknowledging an object that
  would read as a miss. ``remove``: ``UNLINK`` (split per slot on a cluster by redis-py).
- ``read_parts_into``: ``GET`` straight into the destination, ``stripe_concurrency`` parts at
  a time (that many workers, not a task per part), ending at the first missing part.

Parts and commits go over the fast path (``fastpath``: no copies of the payload) when it is
on; through redis-py when it is off, and whenever the fast path reports a moved cluster slot.

With ``min_replicas_ack = n`` the commit and the ``PERSIST`` pipeline end with ``WAIT n
timeout`` on their own connection. Replication is one ordered stream, so a ``WAIT`` after the
last write of a put covers every earlier write of it (parts included); fewer than ``n``
acknowledgements make the put fail with ``Unavailable``. Such a failure is found after the
commit, while ``StripedObjects`` still has superseded parts to clean up, so ``swap`` and
``set_ttl`` record it in the put's ``WriteCheck`` (a context variable the connector sets) and
the connector raises once ``StripedObjects.put`` is done.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from connectors.redis.client import RedisClient
from connectors.redis.fastpath import FastPath
from connectors.redis.resp import command, set_command
from gateway.errors import Unavailable
from gateway.parts import INLINE, MANIFEST_SIZE, bounded_all
from gateway.types import Buffer


class WriteCheck:
    """Problems found after the commit of one put (see module docs)."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.commit: tuple[bytes, bytes] | None = None  # (main key, the value committed)

    def raise_if_any(self) -> None:
        if self.problems:
            raise Unavailable("; ".join(self.problems))


_CHECK: ContextVar[WriteCheck | None] = ContextVar("kvgate_redis_write_check", default=None)


@contextlib.contextmanager
def write_check() -> Iterator[WriteCheck]:
    """The ``WriteCheck`` that backend calls in this context report to."""
    check = WriteCheck()
    token = _CHECK.set(check)
    try:
        yield check
    finally:
        _CHECK.reset(token)


def _report(problem: str) -> None:
    check = _CHECK.get()
    if check is None:
        raise Unavailable(problem)
    check.problems.append(problem)


async def run_bounded(calls: Sequence[Callable[[], Awaitable[object]]], limit: int) -> None:
    """Every call, at most ``limit`` at a time. On a failure the others are cancelled and
    awaited before it propagates: none keeps reading a caller's buffer afterwards."""

    async def one(i: int) -> bool:
        await calls[i]()
        return True

    await bounded_all(len(calls), limit, one)


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


_INLINE_MARK = bytes([INLINE])
_FOREIGN_MARK = b"\xff"  # parse_head calls it malformed: nothing of ours to clean up


def _superseded(head: object, length: object) -> bytes | None:
    """The value a commit replaced, as far as ``StripedObjects`` needs it: the whole value
    when it is short enough to be a manifest, else a one-byte stand-in (an inline object, or
    something not ours). None: there was none. Only ``MANIFEST_SIZE`` bytes ever travel, so
    overwriting or deleting a large inline object does not send it back."""
    if not isinstance(head, bytes) or not isinstance(length, int):
        return _FOREIGN_MARK  # WRONGTYPE: a key of another type, now overwritten
    if length == 0:
        return None
    if length == len(head):
        return head
    return _INLINE_MARK if head[:1] == _INLINE_MARK else _FOREIGN_MARK


def _exec_result(replies: Sequence[object]) -> list[object]:
    """The results of ``MULTI; c1; c2; c3; EXEC`` sent over the fast path (errors raised)."""
    for reply in replies[:4]:  # +OK, +QUEUED...: an error here aborted the transaction
        if isinstance(reply, Exception):
            raise reply
    result = replies[4]
    if isinstance(result, Exception):
        raise result
    if not isinstance(result, list) or len(result) != 3:
        raise RedisConnectionError(f"unexpected EXEC reply {result!r:.80}")
    return result


class RedisParts:
    """The ``gateway.parts.PartBackend`` of the Redis connectors (module docs)."""

    def __init__(
        self,
        client: RedisClient,
        fast: FastPath | None,
        *,
        stripe_concurrency: int,
        min_replicas_ack: int = 0,
        replicas_ack_timeout: float = 1.0,
    ) -> None:
        self.client = client
        self.fast = fast
        self.stripe = stripe_concurrency
        self.min_replicas = min_replicas_ack
        self.ack_timeout_ms = _ms(replicas_ack_timeout)

    async def _value(self, what: str, call: Callable[[], Awaitable[Any]]) -> bytes | None:
        """A reply that is a value or nil (the client never decodes replies to str)."""
        value = await self.client.run(what, call)
        assert value is None or isinstance(value, bytes)
        return value

    async def read(self, key: bytes) -> Buffer | None:
        return await self._value("get", lambda: self.client.redis.get(key))

    async def read_parts_into(self, keys: Sequence[bytes], dsts: Sequence[memoryview]) -> bool:
        return await bounded_all(
            len(keys), self.stripe, lambda i: self._read_part(keys[i], dsts[i])
        )

    async def _read_part(self, key: bytes, dst: memoryview) -> bool:
        if self.fast is not None:
            got = await self.fast.read_into(key, dst)
            if got is not None:
                return got
        value = await self._value("get part", lambda: self.client.redis.get(key))
        if value is None or len(value) != dst.nbytes:
            return False
        dst[:] = value
        return True

    async def write_parts(self, items: Sequence[tuple[bytes, memoryview]], ttl: float) -> None:
        px = _ms(ttl)
        calls = [functools.partial(self._write_part, key, value, px) for key, value in items]
        await run_bounded(calls, self.stripe)

    async def _write_part(self, key: bytes, value: memoryview, px: int) -> None:
        if self.fast is not None and await self.fast.write(key, [value], px):
            return
        await self.client.run("put part", lambda: self.client.redis.set(key, value, px=px))

    async def swap(
        self, key: bytes, value: Sequence[memoryview], ttl: float | None
    ) -> Buffer | None:
        px = None if ttl is None else _ms(ttl)
        check = _CHECK.get()
        if check is not None and len(value) == 1:  # a manifest: set_ttl may need to see it
            check.commit = (key, bytes(value[0]))
        if self.fast is not None:
            wait = [self._wait_command()] if self.min_replicas else []
            chunks = [
                command(b"MULTI"),
                command(b"GETRANGE", key, b"0", b"%d" % (MANIFEST_SIZE - 1)),
                command(b"STRLEN", key),
                *set_command(key, value, px),
                command(b"EXEC"),
                *wait,
            ]
            replies = await self.fast.call(key, "put", chunks, 5 + len(wait))
            if replies is not None:
                if wait:
                    self._check_wait_reply(replies[5])
                try:
                    result = _exec_result(replies[:5])
                except RedisError as exc:
                    raise self.client.error(exc, "put") from exc
                return self._committed(result, "put")
        # redis-py's SET takes one value: an inline object (tag byte + data, at most
        # inline_max) is joined; a manifest is one piece already.
        data = value[0] if len(value) == 1 else b"".join(value)
        redis = self.client.redis

        async def transaction() -> list[Any]:
            async with redis.pipeline(transaction=True) as pipe:
                pipe.getrange(key, 0, MANIFEST_SIZE - 1)
                pipe.strlen(key)
                pipe.set(key, data, px=px)
                return list(await pipe.execute(raise_on_error=False))

        return self._committed(await self.client.run("put", transaction), "put")

    async def take(self, key: bytes) -> Buffer | None:
        redis = self.client.redis

        async def transaction() -> list[Any]:
            async with redis.pipeline(transaction=True) as pipe:
                pipe.getrange(key, 0, MANIFEST_SIZE - 1)
                pipe.strlen(key)
                pipe.execute_command("UNLINK", key)  # a cluster pipeline queues only this form
                return list(await pipe.execute(raise_on_error=False))

        head, length, removed = await self.client.run("delete", transaction)
        if isinstance(removed, Exception):
            raise self.client.error(removed, "delete")
        if not removed:
            return None
        return _superseded(head, length) or b""  # b"": it existed (an empty value)

    def _committed(self, replies: Sequence[object], what: str) -> bytes | None:
        """What a commit replaced, from its transaction's replies (GETRANGE, STRLEN, SET)."""
        head, length, done = replies
        if isinstance(done, Exception):
            raise self.client.error(done, what)
        return _superseded(head, length)

    def _wait_command(self) -> bytes:
        return command(b"WAIT", b"%d" % self.min_replicas, b"%d" % self.ack_timeout_ms)

    def _check_wait_reply(self, reply: object) -> None:
        if isinstance(reply, Exception):  # UNBLOCKED: the master was demoted meanwhile
            _report(str(self.client.error(reply, "put (waiting for replicas)")))
        else:
            assert isinstance(reply, int)
            self._check_acked(reply)

    async def set_ttl(self, keys: Sequence[bytes], ttl: float | None) -> None:
        if not keys:
            return
        redis = self.client.redis
        wait = self.min_replicas > 0

        async def pipeline() -> list[Any]:
            async with redis.pipeline(transaction=False) as pipe:
                for key in keys:
                    if ttl is None:
                        pipe.persist(key)
                    else:
                        pipe.pexpire(key, _ms(ttl))
                if wait:
                    pipe.execute_command("WAIT", self.min_replicas, self.ack_timeout_ms)
                return list(await pipe.execute())

        replies = await self.client.run("put (parts ttl)", pipeline)
        if wait:
            self._check_acked(int(replies.pop()))
        missing = sum(1 for reply in replies if not reply)
        if missing and await self._still_ours():
            _report(
                f"{self.client.target.redacted}: {missing} of {len(keys)} parts were gone at "
                "commit time (evicted, or lost in a failover); the object will read as a miss"
            )

    async def _still_ours(self) -> bool:
        """Whether the main key still holds this put's manifest: parts removed by a later
        put that superseded it are no failure of this one."""
        check = _CHECK.get()
        if check is None or check.commit is None:
            return True
        key, manifest = check.commit
        return await self._value("put (check)", lambda: self.client.redis.get(key)) == manifest

    async def remove(self, keys: Sequence[bytes]) -> None:
        if keys:
            await self.client.run("delete parts", lambda: self.client.redis.unlink(*keys))

    def _check_acked(self, acked: int) -> None:
        if acked < self.min_replicas:
            _report(
                f"{self.client.target.redacted}: only {acked} of {self.min_replicas} replicas "
                f"acknowledged the write within {self.ack_timeout_ms} ms"
            )
