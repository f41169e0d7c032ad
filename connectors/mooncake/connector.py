"""``mooncake://master:port`` — Mooncake Store, the distributed in-memory KV-cache store.

Each kvgate object is one Mooncake value (``blob``: payload + a 4 or 5 byte trailer), so a
reader gets one whole version or nothing: Mooncake publishes a value only when its transfer is
done, and an overwrite always changes the stored size, which makes Mooncake place it in new
replicas instead of rewriting the old ones under a reader (see ``blob``). While an overwrite
runs, Mooncake reports the key as being written (a read waits and retries) and, for a moment,
as missing; so within this process reads of a key wait for writes of it and writes wait for
reads in flight (``rwlocks``), and a reader never sees a miss or a mix. Readers in *other*
processes can see that brief miss during an overwrite (``exists`` says False meanwhile too),
and two processes overwriting one key with different bytes of the same size at the same
instant could meet in place; KV-cache keys name their content, so in practice such writes
carry equal bytes. An overwrite parks the old value's memory on the master until
``put_start_release_timeout_sec`` (600 s by default), so readers still copying it stay safe: a
workload that overwrites much should lower it.

Data path: a put copies its parts (the scatter list, no join) into a block of the staging
arena registered with the transfer engine, appends the trailer, asks the size stored now (for
the trailer) and upserts from there; a get reads the value into a staging block and copies the
payload into the caller's buffer (``get_into``: a pool slab; ``get``: a new buffer). One copy
each way, as Mooncake's own ``put``/``get`` make, but ``get_into`` copies into memory that is
already faulted in. A read guesses the value's size (the last size this connector saw) and so
needs one round trip to the master; a wrong guess costs a size query. The staging arena
(``local_buffer_size``) bounds the object size, ``capabilities.max_object_size``: a larger put
is a CapacityError, and so is a put into a full store (NO_AVAILABLE_HANDLE).

Blocking calls run in a dedicated pool of ``threads`` threads, the most recently idle one
taking the next call (``gateway.recent_threads``: Mooncake's client ran one caller's
back-to-back calls faster on one thread than rotating over four, and after an idle spell much
faster). A Mooncake client closed while another is open in the same process slowed the open
one's puts about 2.5x for its lifetime (measured here; the README has the figures): this
connector keeps one client for its lifetime and closes it last. Every call has a deadline
(``timeout``): past it the caller gets ``Timeout`` at once, while the Mooncake call finishes in
its thread against staging memory only (``client``). The client is set up lazily by the first
call, in that pool and under that call's deadline (an unreachable master otherwise blocks
setup for a minute and a half); a failed setup is retried by the next call. A put abandoned
after its transfer began may still land.

Keys: ``namespace`` + the hex blake2b-160 of the key's UTF-8 bytes. Any string maps (NUL,
separators, 1000 characters, lone surrogates), every Mooncake key has the same short ASCII
form, and distinct keys do not collide (160 bits); Mooncake cannot list, so nothing needs the
key back.

Delete waits for readers' leases to end (Mooncake refuses to remove a leased object; the lease
is the master's ``default_kv_lease_ttl``, 10 s by default in this release): it is reported done
only when the object is gone, and raises Timeout if the lease outlives the deadline. ``exists``
grants a lease too. A store's discard of an object its read found corrupt or expired
(``discarding_unusable``) removes it with Mooncake's ``force`` instead: that read took a lease
itself, and readers verify what they read. Mooncake cannot list keys (capabilities.list is
False) and has no TTL; objects live in other processes' segments, so they outlive this
connector (``persistent``) unless this process contributes a segment of its own
(``global_segment_size``) that may hold them.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, ClassVar, TypeVar

import numpy as np

from connectors._options import parse_options
from connectors.mooncake import blob
from connectors.mooncake.client import Job, MooncakeClient
from connectors.mooncake.config import MooncakeOptions, Target, resolve
from connectors.mooncake.rwlocks import ReadWriteLocks
from gateway.connector import Allocator, BaseConnector, as_parts, discarding_unusable
from gateway.errors import CapacityError, GatewayError, Timeout
from gateway.inflight import InFlight
from gateway.recent_threads import RecentThreadPool
from gateway.types import Buffer, BufferParts, Capabilities

log = logging.getLogger(__name__)
T = TypeVar("T")
INLINE_COPY_BYTES = 4 << 20  # smaller copies run on the loop: a thread hop costs more
CLOSE_SECONDS = 10.0  # Mooncake's own close takes about 1 s


class MooncakeConnector(BaseConnector):
    scheme: ClassVar[str] = "mooncake"

    def __init__(self, target: Target, options: MooncakeOptions) -> None:
        self.target = target
        self.options = options
        staging = options.local_buffer_size // 256 * 256  # the pool's alignment
        self.capabilities = Capabilities(
            batch=True,  # exists_many is one batch_is_exist call
            list=False,
            ttl=False,
            zero_copy=True,
            persistent=options.global_segment_size == 0,
            max_object_size=staging - 256 - blob.MAX_TRAILER,
        )
        # Serial calls stay on one thread (gateway.recent_threads: Mooncake's client ran them
        # faster there, and much faster after an idle spell, than rotating over 4 threads).
        self._threads = RecentThreadPool(options.threads, thread_name_prefix="kvgate-mooncake")
        self._client: MooncakeClient | None = None
        self._setup: Future[MooncakeClient] | None = None
        self._keys = ReadWriteLocks()
        # The stored size of the last value read or written: KV chunks mostly share one size,
        # and a read that guesses it right needs one round trip to the master, not two.
        self._size_hint = 0
        self._fair_share = staging // options.threads
        self._in_flight = InFlight()
        self._closed = False

    @classmethod
    def from_url(cls, url: str, **options: Any) -> MooncakeConnector:
        opts = parse_options(MooncakeOptions, url, options)
        return cls(resolve(url, opts), opts)

    def __repr__(self) -> str:
        return f"MooncakeConnector({self.target.shown})"

    def key_for(self, key: str) -> str:
        """The Mooncake key of ``key``: namespace + a hash (any string maps, none collide)."""
        raw = key.encode("utf-8", "surrogatepass")
        return self.options.namespace + hashlib.blake2b(raw, digest_size=20).hexdigest()

    # -- calls ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _op(self) -> Iterator[None]:
        if self._closed:
            raise GatewayError(f"{self!r} is closed")
        with self._in_flight.track():
            yield

    def _deadline(self) -> float:
        return time.monotonic() + self.options.timeout

    async def _ready(self, deadline: float) -> MooncakeClient:
        """The set-up client; the first call sets it up (in the pool, under its deadline)."""
        if self._client is not None:
            return self._client
        if self._setup is None:
            self._setup = self._threads.submit(self._make_client)
        setup = self._setup
        try:
            async with asyncio.timeout_at(_loop_time(deadline)):
                client = await asyncio.shield(asyncio.wrap_future(setup))
        except TimeoutError:
            raise Timeout(
                f"{self!r}: no Mooncake master answered at {self.target.master} within "
                f"{self.options.timeout:g} s"
            ) from None
        except Exception:
            if self._setup is setup and setup.done():
                self._setup = None  # it failed: the next call tries again
            raise
        self._client = client
        return client

    def _make_client(self) -> MooncakeClient:
        client = MooncakeClient(self.target, self.options)
        try:
            client.setup()
        except BaseException:
            with contextlib.suppress(GatewayError):
                client.close()
            raise
        return client

    async def _run(self, work: Callable[[MooncakeClient, Job], T], what: str) -> T:
        """``work(client, job)`` in the pool, bounded by the timeout (see the module doc)."""
        deadline = self._deadline()
        client = await self._ready(deadline)
        # The thread's own deadline comes a little earlier, so that a call that keeps being
        # refused (a lease, a replica being written) ends with its reason, not a bare timeout.
        job = Job(deadline - min(0.05, self.options.timeout / 10))
        future = asyncio.wrap_future(self._threads.submit(work, client, job))
        try:
            async with asyncio.timeout_at(_loop_time(deadline)):
                return await asyncio.shield(future)
        except TimeoutError:
            await _abandon(job, future)
            raise Timeout(f"{what}: no result within {self.options.timeout:g} s") from None
        except asyncio.CancelledError:
            await _abandon(job, future)
            raise

    # -- the connector --------------------------------------------------------------------

    async def put(self, key: str, data: BufferParts) -> None:
        parts = as_parts(data)
        size = sum(p.nbytes for p in parts)
        limit = self.capabilities.max_object_size
        if limit is not None and size > limit:
            raise CapacityError(
                f"{self!r}: an object of {size} bytes is larger than this connector's limit of "
                f"{limit} bytes (its staging memory, local_buffer_size="
                f"{self.options.local_buffer_size})"
            )
        what = f"{self!r}: put {key!r}"
        mkey = self.key_for(key)
        with self._op():
            async with self._keys.writing(key):
                await self._run(lambda c, job: c.write(mkey, parts, size, job, what), what)
            self._size_hint = size + blob.SHORT

    async def get(self, key: str) -> Buffer | None:
        return await self.get_into(key, _fresh)

    async def get_into(self, key: str, alloc: Allocator) -> memoryview | None:
        what = f"{self!r}: get {key!r}"
        mkey = self.key_for(key)
        # A hint larger than a fair share of the staging memory would hold up other reads.
        hint = self._size_hint if self._size_hint <= self._fair_share else 0
        with self._op():
            async with self._keys.reading(key):
                block = await self._run(lambda c, job: c.read(mkey, job, what, hint), what)
            if block is None:
                return None
            try:
                stored = block.view
                self._size_hint = stored.nbytes
                n = blob.payload_length(stored, what)
                dst = alloc(n)
                if dst is None:
                    dst = memoryview(bytearray(n))
                elif dst.nbytes != n:
                    raise ValueError(f"alloc({n}) gave {dst.nbytes} bytes")
                await _copy(dst, stored[:n])
            finally:
                block.release()
            return dst

    async def exists(self, key: str) -> bool:
        what = f"{self!r}: exists {key!r}"
        mkey = self.key_for(key)
        with self._op():
            async with self._keys.reading(key):
                return await self._run(lambda c, job: c.exists(mkey, what), what)

    async def exists_many(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        what = f"{self!r}: exists of {len(keys)} keys"
        mkeys = [self.key_for(k) for k in keys]
        with self._op():
            async with self._keys.reading_many(keys):
                return await self._run(lambda c, job: c.exists_many(mkeys, what), what)

    async def delete(self, key: str) -> bool:
        what = f"{self!r}: delete {key!r}"
        mkey = self.key_for(key)
        with self._op():
            async with self._keys.writing(key):
                # A corrupt object's reader holds a lease on it (its get took one): a wait
                # for it would stall that get for the lease's 10 s. Other readers verify.
                force = discarding_unusable()
                return await self._run(lambda c, job: c.remove(mkey, job, what, force=force), what)

    async def ping(self) -> bool:
        what = f"{self!r}: ping"
        probe = self.key_for("kvgate-ping")
        with self._op():
            await self._run(lambda c, job: c.ping(probe, what), what)
        return True

    async def close(self) -> None:
        """Wait for calls in flight, then close the client once its threads are done."""
        if self._closed:
            return
        self._closed = True
        await self._in_flight.wait_idle()
        closing = asyncio.ensure_future(asyncio.to_thread(self._shut_down))
        try:
            async with asyncio.timeout(max(self.options.timeout, CLOSE_SECONDS)):
                await asyncio.shield(closing)
        except TimeoutError:
            log.warning("%r: a Mooncake call is still running; closing in the background", self)

    def _shut_down(self) -> None:
        # Abandoned calls may still run: the client (and its staging memory) outlives them.
        self._threads.shutdown(wait=True, cancel_futures=True)
        client = self._client
        setup = self._setup
        if client is None and setup is not None and setup.done() and not setup.cancelled():
            client = setup.result() if setup.exception() is None else None
        if client is not None:
            try:
                client.close()
            except GatewayError as exc:
                log.warning("%r: closing the Mooncake client: %s", self, exc)

    @classmethod
    async def raw_client_baseline(
        cls,
        url: str,
        options: Mapping[str, Any],
        *,
        size: int,
        count: int,
        concurrency: int,
        payloads: Sequence[bytes] = (),
    ) -> tuple[float, float]:
        """(put GB/s, get GB/s) of Mooncake's plain ``put(key, bytes)`` / ``get(key)``."""
        from connectors.mooncake.baseline import raw_put_get

        opts = parse_options(MooncakeOptions, url, options)
        return await asyncio.to_thread(
            raw_put_get,
            resolve(url, opts),
            opts,
            size=size,
            count=count,
            threads=concurrency,
            payloads=payloads,
        )


def _loop_time(deadline: float) -> float:
    """A ``time.monotonic`` deadline on the running loop's clock."""
    loop = asyncio.get_running_loop()
    return loop.time() + (deadline - time.monotonic())


def _fresh(nbytes: int) -> memoryview:
    return memoryview(bytearray(nbytes))


async def _abandon(job: Job, future: asyncio.Future[Any]) -> None:
    """Give up on ``future``: if its thread is copying the caller's buffers, wait for that."""
    future.cancel()  # a call still queued never starts
    future.add_done_callback(_consume)
    returned = job.abandon()
    if returned is None:
        return
    while not returned.is_set():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.to_thread(returned.wait, 0.1)


def _consume(future: asyncio.Future[Any]) -> None:
    """Retrieve an abandoned call's outcome: nobody waits for it any more."""
    if not future.cancelled():
        future.exception()


async def _copy(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src`` off the loop for large buffers; waits for the copy even if cancelled
    (``src`` is a staging block released right after, ``dst`` the caller's)."""
    target = np.frombuffer(dst.cast("B"), dtype=np.uint8)
    source = np.frombuffer(src, dtype=np.uint8)
    if src.nbytes < INLINE_COPY_BYTES:
        np.copyto(target, source)
        return
    job = asyncio.ensure_future(asyncio.to_thread(np.copyto, target, source))
    try:
        await asyncio.shield(job)
    except asyncio.CancelledError:
        while not job.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait((job,))
        raise
