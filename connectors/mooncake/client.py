"""The blocking half of the connector: one Mooncake store client and what runs in its threads.

Mooncake's Python API is synchronous C++: every method here blocks, and the connector runs each
call in its own bounded thread pool, never on the event loop. A call gets a ``Job``: its
deadline and a stop flag. The connector abandons a job whose deadline passed or whose caller
was cancelled; the thread notices the flag between Mooncake calls and stops retrying, and
whatever staging block it holds goes back to the pool when it returns.

A job may *borrow* the caller's buffers (a put copies them into staging). Borrowing is only
allowed while the caller still waits, and a caller that gives up while its buffers are being
copied waits for that copy to end first (one memcpy), so no thread ever touches a caller's
buffer after the call returned.

Retries inside a job, bounded by its deadline: a replica still being written (an overwrite in
progress; REPLICA_IS_NOT_READY), a lease that expired before a read finished (LEASE_EXPIRED:
Mooncake cannot vouch for the bytes, so read again), a value whose size changed between the
size query and the read, and a remove refused because a reader holds a lease on the object
(OBJECT_HAS_LEASE: wait for the lease to end; a remove is never reported done when it was not).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from connectors.mooncake import blob
from connectors.mooncake import errors as codes
from connectors.mooncake.config import MooncakeOptions, Target
from connectors.mooncake.staging import Staging
from gateway.errors import CapacityError, GatewayError, MissingDependency, Timeout, Unavailable
from gateway.memory import Slab

_RETRY_READ = {codes.REPLICA_IS_NOT_READY, codes.LEASE_EXPIRED}
# A copy or move task on the key, a replica in use by the master: both end soon.
_BUSY = {codes.OBJECT_HAS_REPLICATION_TASK, codes.OBJECT_REPLICA_BUSY}
_RETRY_WRITE = {codes.REPLICA_IS_NOT_READY, *_BUSY}
_RETRY_REMOVE = {codes.OBJECT_HAS_LEASE, codes.REPLICA_IS_NOT_READY, *_BUSY}
_SIZE_CHANGES = 8  # reads that find the value resized under them before giving up


def load_store_class() -> Any:
    """``mooncake.store.MooncakeDistributedStore``, or MissingDependency saying what to install."""
    try:
        from mooncake.store import MooncakeDistributedStore  # type: ignore[import-untyped]
    except ModuleNotFoundError as exc:
        raise MissingDependency(
            f"mooncake:// needs Mooncake's Python API ({exc}): "
            "pip install 'kvgate[mooncake]' (or mooncake-transfer-engine on a CUDA host)"
        ) from exc
    except ImportError as exc:  # the wheel is there but a shared library it links is not
        raise MissingDependency(
            f"mooncake:// cannot load Mooncake's store module: {exc} "
            "(on Debian/Ubuntu: apt-get install libibverbs1)"
        ) from exc
    return MooncakeDistributedStore


class Job:
    """One blocking call's deadline, stop flag and hold on the caller's buffers."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._borrowing = False
        self._returned = threading.Event()

    def borrow(self) -> bool:
        """Start using the caller's buffers; False if the caller has gone."""
        with self._lock:
            if self.stop.is_set():
                return False
            self._borrowing = True
            return True

    def give_back(self) -> None:
        with self._lock:
            self._borrowing = False
            self._returned.set()

    def abandon(self) -> threading.Event | None:
        """Tell the thread to stop; the event to wait for if it is using the caller's buffers."""
        with self._lock:
            self.stop.set()
            return self._returned if self._borrowing else None

    def pause(self, attempt: int, code: int, what: str) -> None:
        """Sleep before retry number ``attempt``, or raise if the deadline (or a stop) came."""
        left = self.deadline - time.monotonic()
        if self.stop.is_set() or left <= 0:
            raise Timeout(f"{what}: still {codes.describe(code)} when the deadline came")
        self.stop.wait(min(0.001 * 2**attempt, 0.05, left))


class StagedBlock:
    """A staging block holding one stored value (``view``: exactly its bytes)."""

    def __init__(self, staging: Staging, slab: Slab) -> None:
        self.slab = slab
        self.address = staging.address(slab)
        self.view = slab.view()

    def release(self) -> None:
        self.slab.release()


class MooncakeClient:
    """A set-up ``MooncakeDistributedStore`` with its staging arena; every method blocks."""

    def __init__(self, target: Target, options: MooncakeOptions) -> None:
        store_class = load_store_class()
        from mooncake.store import ReplicateConfig

        self.target = target
        self.options = options
        self.staging = Staging(options.local_buffer_size)
        self.replicate = ReplicateConfig()
        self.replicate.replica_num = options.replica_num
        if options.preferred_segment:
            self.replicate.preferred_segment = options.preferred_segment
        self.store = store_class()
        self._registered = False

    def setup(self) -> None:
        o = self.options
        rc = self._call(
            "setup",
            self.store.setup,
            o.local_hostname,
            self.target.metadata_server,
            o.global_segment_size,
            0,  # Mooncake's own transfer buffer: unused, every transfer goes through staging
            o.protocol,
            o.device_name,
            self.target.master,
        )
        if rc != 0:
            raise Unavailable(
                f"{self.target.shown}: no Mooncake client (setup returned {rc}); is "
                f"mooncake_master serving {self.target.master} and the metadata server "
                f"{self.target.metadata_server}?"
            )
        rc = self._call(
            "register_buffer", self.store.register_buffer, self.staging.base, self.staging.capacity
        )
        codes.check(rc, f"{self.target.shown}: registering the staging memory")
        self._registered = True

    def close(self) -> None:
        if self._registered:
            self._registered = False
            self._call("unregister_buffer", self.store.unregister_buffer, self.staging.base)
        self._call("close", self.store.close)

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``; an exception from the binding becomes a GatewayError."""
        try:
            return fn(*args)
        except GatewayError:
            raise
        except Exception as exc:  # pybind11 turns C++ exceptions into RuntimeError & co.
            raise GatewayError(f"{self.target.shown}: Mooncake {what} raised {exc!r}") from exc

    # -- the operations, each in a worker thread --------------------------------------------

    def ping(self, probe: str, what: str) -> None:
        """Raise unless the master answers (its health flag alone lags a dead master)."""
        health = int(self._call("health_check", self.store.health_check))
        if health != 0:
            raise Unavailable(f"{what}: Mooncake health check says {health} (2: no master)")
        self.exists(probe, what)

    def exists(self, mkey: str, what: str) -> bool:
        rc = int(self._call("is_exist", self.store.is_exist, mkey))
        codes.check(rc, what)
        return rc == 1

    def exists_many(self, mkeys: Sequence[str], what: str) -> list[bool]:
        rcs = self._call("batch_is_exist", self.store.batch_is_exist, list(mkeys))
        out = []
        for rc in rcs:
            if rc < 0:
                raise codes.error_for(int(rc), what)
            out.append(rc == 1)
        return out

    def write(self, mkey: str, parts: list[memoryview], size: int, job: Job, what: str) -> None:
        """Store ``parts`` (``size`` bytes in all) as one value under ``mkey``."""
        slab = self.staging.take(size + blob.MAX_TRAILER, job.deadline)
        try:
            if not job.borrow():
                return  # the caller is gone before a byte was copied: nothing to do
            try:
                dst = np.frombuffer(slab.view(), dtype=np.uint8)
                offset = 0
                for part in parts:  # numpy copies release the GIL, memoryview slices do not
                    n = part.nbytes
                    np.copyto(dst[offset : offset + n], np.frombuffer(part, dtype=np.uint8))
                    offset += n
                parts.clear()  # keep no reference to the caller's buffers
            finally:
                job.give_back()
            address = self.staging.address(slab)
            for attempt in itertools.count():
                if job.stop.is_set():
                    return  # the caller has gone: better not to write what it gave up on
                stored_now = self._size(mkey, what)
                trailer = blob.trailer_for(size, stored_now)
                dst[size : size + len(trailer)] = np.frombuffer(trailer, dtype=np.uint8)
                rc = self._call(
                    "upsert_from",
                    self.store.upsert_from,
                    mkey,
                    address,
                    size + len(trailer),
                    self.replicate,
                )
                if rc not in _RETRY_WRITE:
                    codes.check(rc, what)
                    return
                job.pause(attempt, rc, what)
        finally:
            slab.release()

    def _size(self, mkey: str, what: str) -> int | None:
        """The stored size of ``mkey`` now; None if absent or being written (a new upsert then
        replaces the unfinished one with new replicas)."""
        n = int(self._call("get_size", self.store.get_size, mkey))
        if n in (codes.OBJECT_NOT_FOUND, codes.REPLICA_IS_NOT_READY):
            return None
        codes.check(n, what)
        return n

    def read(self, mkey: str, job: Job, what: str, hint: int = 0) -> StagedBlock | None:
        """The stored value of ``mkey`` in a staging block, or None if there is none.

        ``hint``: the size the value probably has (KV chunks mostly share one). A read into a
        block that large takes one round trip to the master; without a hint, or when the
        value turns out larger, the size is asked first (two).
        """
        resized = 0
        for attempt in itertools.count():
            if hint > 0:
                n = hint
            else:
                n = int(self._call("get_size", self.store.get_size, mkey))
                if n == codes.OBJECT_NOT_FOUND:
                    return None
                if n in _RETRY_READ:
                    job.pause(attempt, n, what)
                    continue
                codes.check(n, what)
            block = self._block(n, job, what)
            try:
                rc = int(self._call("get_into", self.store.get_into, mkey, block.address, n))
            except BaseException:
                block.release()
                raise
            if rc == n or (hint > 0 and 0 <= rc < n):
                block.view = block.view[:rc]
                return block
            block.release()
            if rc == codes.OBJECT_NOT_FOUND:
                return None
            if hint > 0 and rc == codes.INVALID_PARAMS:
                hint = 0  # larger than the hint: ask its size
                continue
            if rc >= 0 or rc == codes.INVALID_PARAMS:
                # Resized between the size query and the read (a smaller value reads short, a
                # larger one does not fit): ask again, a few times.
                resized += 1
                if resized < _SIZE_CHANGES:
                    continue
                rc = codes.INVALID_PARAMS if rc >= 0 else rc
            if rc not in _RETRY_READ:
                codes.check(rc, what)
            job.pause(attempt, rc, what)
        raise AssertionError("unreachable")

    def _block(self, nbytes: int, job: Job, what: str) -> StagedBlock:
        if nbytes > self.staging.capacity:
            raise CapacityError(
                f"{what}: the stored value has {nbytes} bytes, more than this connector's "
                f"staging memory ({self.staging.capacity} bytes; raise local_buffer_size)"
            )
        return StagedBlock(self.staging, self.staging.take(nbytes, job.deadline))

    def remove(self, mkey: str, job: Job, what: str, *, force: bool = False) -> bool:
        """Remove ``mkey``; whether it was there. Waits out a reader's lease on it, unless
        ``force`` (Mooncake's own flag: the bytes are unusable, and readers verify theirs)."""
        for attempt in itertools.count():
            # Only a forced remove passes the flag: older bindings take the key alone.
            args = (mkey, True) if force else (mkey,)
            rc = int(self._call("remove", self.store.remove, *args))
            if rc == codes.OK:
                return True
            if rc == codes.OBJECT_NOT_FOUND:
                return False
            if rc not in _RETRY_REMOVE:
                codes.check(rc, what)
            job.pause(attempt, rc, what)
        raise AssertionError("unreachable")
