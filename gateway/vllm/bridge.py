"""A Store for synchronous callers (vLLM's connector methods): the Store lives on an event
loop in a thread of its own, and calls cross over with ``run_coroutine_threadsafe``.

Saves are fire-and-forget but bounded: at most ``max_pending`` chunks handed over and not yet
stored; past that a save is dropped and counted (a later request recomputes that chunk, which
costs time, never correctness), so vLLM's step never waits for a slow tier. Loads and lookups
wait, each bounded by ``timeout``; a failure or a timeout is reported to the caller as a miss.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

from gateway.errors import GatewayError
from gateway.log_limit import RepeatLimiter
from gateway.store import Store

log = logging.getLogger("kvgate.vllm")
T = TypeVar("T")

START_TIMEOUT = 120.0  # seconds to open the Store (a large pool is prefaulted at open)
CLOSE_TIMEOUT = 60.0  # seconds shutdown waits for queued saves


class StoreThread:
    """One Store on its own loop thread. ``start`` opens it, ``close`` drains and closes it."""

    def __init__(
        self,
        make_store: Callable[[], Store],
        *,
        max_pending: int,
        timeout: float,
        on_loop: Callable[[Store], Awaitable[object]] | None = None,
    ) -> None:
        """``on_loop``: awaited on the loop once the store is open (a server on the store)."""
        self._make_store = make_store
        self._on_loop = on_loop
        self.timeout = timeout
        self.max_pending = max_pending
        self._pending = 0  # saves handed over and not finished
        self._idle = threading.Condition()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="kvgate-vllm", daemon=True)
        self._store: Store | None = None
        self._ready = concurrent.futures.Future[None]()
        self._stopping: asyncio.Event | None = None
        self._lines = RepeatLimiter()
        self.skipped_saves = 0
        self.failed_saves = 0

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        self._ready.result(START_TIMEOUT)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        finally:
            self._loop.close()

    async def _main(self) -> None:
        self._stopping = asyncio.Event()
        try:
            store = self._make_store()
            await store.open()
        except BaseException as exc:
            self._ready.set_exception(exc)
            return
        self._store = store
        background = None
        try:
            if self._on_loop is not None:
                background = asyncio.ensure_future(self._on_loop(store))
            self._ready.set_result(None)
            await self._stopping.wait()
        finally:
            if background is not None:
                background.cancel()
                await asyncio.gather(background, return_exceptions=True)
            await store.close()  # drains queued lower-tier writes

    def close(self) -> None:
        """Wait (bounded) for handed-over saves, then close the store and stop the thread."""
        if not self._thread.is_alive():
            return
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0, timeout=CLOSE_TIMEOUT)
        stopping = self._stopping
        if stopping is not None:
            self._loop.call_soon_threadsafe(stopping.set)
        self._thread.join(CLOSE_TIMEOUT)

    # -- calls -------------------------------------------------------------------------------

    @property
    def store(self) -> Store:
        assert self._store is not None, "the store thread is not started"
        return self._store

    def call(self, make: Callable[[Store], Coroutine[Any, Any, T]]) -> T:
        """Run ``make(store)`` on the loop and wait for it (at most ``timeout``)."""
        future = asyncio.run_coroutine_threadsafe(self._bounded(make(self.store)), self._loop)
        return future.result()

    async def _bounded(self, call: Awaitable[T]) -> T:
        async with asyncio.timeout(self.timeout):
            return await call

    def get_many(self, keys: Sequence[str]) -> list[object | None]:
        """The objects under ``keys`` (None for each miss); all None when the store fails."""
        try:
            return self.call(lambda store: store.get_many(keys))
        except (GatewayError, TimeoutError) as exc:
            self._note("load", "kvgate: a load failed, the chunks are recomputed: %s", exc)
            return [None] * len(keys)

    def lookup(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` the store holds (0 when it fails)."""
        try:
            return self.call(lambda store: store.lookup(keys))
        except (GatewayError, TimeoutError) as exc:
            self._note("lookup", "kvgate: a lookup failed, counted as a miss: %s", exc)
            return 0

    def put_later(self, key: str, obj: object, position: int | None = None) -> bool:
        """Hand ``obj`` over to be stored; False (and counted) when too many are pending.
        ``position``: the chunk's first token index (for codecs that undo RoPE, see Store.put)."""
        with self._idle:
            if self._pending >= self.max_pending:
                self.skipped_saves += 1
                full = True
            else:
                self._pending += 1
                full = False
        if full:
            self._note("skip", "kvgate: %d saves pending, a chunk was not saved", self.max_pending)
            return False
        future = asyncio.run_coroutine_threadsafe(self._put(key, obj, position), self._loop)
        future.add_done_callback(self._put_done)
        return True

    def delete_later(self, key: str) -> bool:
        """Delete ``key`` without waiting; False when too many saves or deletes are pending
        (the same bound as ``put_later``'s)."""
        with self._idle:
            if self._pending >= self.max_pending:
                return False
            self._pending += 1
        future = asyncio.run_coroutine_threadsafe(self._delete(key), self._loop)
        future.add_done_callback(self._put_done)
        return True

    async def _delete(self, key: str) -> None:
        try:
            await self._bounded(self.store.delete(key))
        except (GatewayError, TimeoutError) as exc:
            self._note("delete", "kvgate: deleting an unusable chunk failed: %s", exc)

    def _put_done(self, _future: concurrent.futures.Future[None]) -> None:
        with self._idle:
            self._pending -= 1
            self._idle.notify_all()

    @property
    def pending_saves(self) -> int:
        return self._pending

    async def _put(self, key: str, obj: object, position: int | None) -> None:
        try:
            await self._bounded(self.store.put(key, obj, position=position))
        except (GatewayError, TimeoutError) as exc:
            self.failed_saves += 1
            self._note("save", "kvgate: a save failed: %s", exc)

    def _note(self, kind: str, message: str, *args: object) -> None:
        unlogged = self._lines.admit(kind)
        if unlogged is not None:
            more = f" ({unlogged} more since the last such line)" if unlogged else ""
            log.warning(message + more, *args)
