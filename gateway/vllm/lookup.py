"""How vLLM's scheduler asks how many leading chunks the store holds.

vLLM runs the scheduler side of a connector in the engine process and the worker side in a
worker process, and only the worker holds a Store (with a kvgate config its data never
crosses a process; with a gateway its Store has the gateway as its tier) and knows the KV
cache's layout, which is part of every key. So the scheduler asks the worker: the worker
serves lookups on a unix socket in the temp directory named after the engine
(``socket_path``), one JSON line per question (``{"hashes": [...]}``, the chunk hashes, leading
first -> ``{"prefix": n}``, with ``"slow": true`` when the store took over the deadline), and
turns hashes into its keys itself. A failure, a timeout or an
answer that does not parse is 0 chunks: vLLM then computes them, which is slower, never wrong.

vLLM asks from its scheduler, which waits for the answer, and with it every request of the
engine. So the question has its own short deadline (``lookup_timeout``), which the worker keeps
too, and after a lookup that timed out the scheduler answers 0 without asking for
``LOOKUP_BACKOFF`` seconds: a hung store or gateway costs the engine one deadline every so
often rather than one per new request (measured with a stopped gateway: 30 s per new prompt,
for every request scheduled beside it, until the tier's breaker opened ~2.5 minutes later).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import socket
import stat
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from gateway.errors import ConfigError
from gateway.log_limit import RepeatLimiter
from gateway.store import Store

log = logging.getLogger("kvgate.vllm")

MAX_LINE = 1 << 20  # bytes of one question
MAX_CHUNKS = 4096  # chunks of one question (a 1M-token prompt in 256-token chunks)
LOOKUP_BACKOFF = 10.0  # seconds of lookups answered 0 without asking, after one timed out
WORKER_SHARE = 0.8  # of lookup_timeout, the worker's own deadline for answering
ACCEPTED_SETTLE = 0.05  # seconds for connections accepted as the server closes to arrive


def socket_path(engine_id: str) -> str:
    """Where the worker of engine ``engine_id`` answers lookups (a unix socket path, short
    enough for any platform's limit)."""
    digest = hashlib.sha256(engine_id.encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"kvgate-vllm-{digest}.sock")


def claim_socket(path: str, engine_id: str) -> None:
    """Make sure no live worker answers on ``path``; remove one left by a worker that died.

    ``ConfigError`` when another engine's worker answers there: two engines with the same
    ``engine_id`` on one host would answer each other's lookups (and load chunks their own
    store does not hold). Called before the worker starts serving, so vLLM fails at start.
    """
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise ConfigError(f"kvgate: {path} exists and is not a socket; remove it")
    if info.st_uid != os.geteuid():
        raise ConfigError(
            f"kvgate: {path} (engine_id {engine_id!r}) belongs to another user; give this "
            "engine its own engine_id"
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):  # nobody listens: a dead worker's
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    except OSError as exc:  # busy or unreachable, not known dead: not removed
        raise ConfigError(
            f"kvgate: {path} (engine_id {engine_id!r}) exists and does not answer as a dead "
            f"worker's would ({exc}); give this engine its own engine_id"
        ) from None
    finally:
        probe.close()
    raise ConfigError(
        f"kvgate: another vLLM engine on this host already serves lookups as engine_id "
        f"{engine_id!r} ({path}); give each engine its own engine_id"
    )


async def serve_lookups(
    store: Store, path: str, key_of: Callable[[int], str], lookup_timeout: float
) -> None:
    """Answer lookups on ``path`` until cancelled (the socket is the user's alone);
    ``key_of`` turns a chunk hash into this worker's key; a lookup that takes over
    ``lookup_timeout`` seconds is answered 0 (the scheduler has stopped waiting for it)."""
    claim_socket(path, os.path.basename(path))  # a dead worker's is removed, a live one kept
    handlers: dict[asyncio.Task[Any], asyncio.StreamWriter] = {}

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            handlers[task] = writer
        try:
            while line := await reader.readline():
                hashes = _hashes_of(line)
                answer: dict[str, Any] = {"prefix": 0}
                if hashes is not None:
                    try:
                        # A little under the scheduler's own deadline, so that the answer
                        # reaches it before it gives up and drops the connection.
                        async with asyncio.timeout(WORKER_SHARE * lookup_timeout):
                            found = await verified_prefix(store, [key_of(h) for h in hashes])
                        answer["prefix"] = found
                    except TimeoutError:  # the scheduler backs off, as after its own timeout
                        answer["slow"] = True
                    except Exception as exc:  # a miss for the scheduler, a line for the operator
                        log.debug("kvgate lookup failed: %s", exc)
                writer.write(json.dumps(answer).encode() + b"\n")
                await writer.drain()
        except (ValueError, ConnectionError):  # a line over MAX_LINE, or the peer went away
            pass
        finally:
            writer.close()
            if task is not None:
                handlers.pop(task, None)

    server = await asyncio.start_unix_server(answer, path, limit=MAX_LINE)
    os.chmod(path, 0o600)
    try:
        await asyncio.Future()  # until cancelled
    finally:
        server.close()
        # A connection accepted just before takes a few loop turns to reach its handler
        # (accept task, connection_made, the handler's first step), and one whose handler
        # never ran is never closed (a ResourceWarning later): let them arrive first.
        await asyncio.sleep(ACCEPTED_SETTLE)
        # Connections outlive the server: closing each ends its handler's read (cancelling
        # the handler instead makes Python 3.11's stream callback raise CancelledError).
        for writer in list(handlers.values()):
            writer.close()
        if handlers:
            await asyncio.wait(list(handlers), timeout=5.0)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


async def verified_prefix(store: Store, keys: Sequence[str]) -> int:
    """How many leading ``keys`` the store holds and can read back whole: the objects are
    read (and so verified, and promoted into the memory tier for the load that follows), so a
    corrupted or vanished chunk is a miss now rather than a failed load later (vLLM's default
    ``kv_load_failure_policy`` fails a request whose load fails)."""
    found = await store.lookup(keys)
    if not found:
        return 0
    objects = await store.get_many(keys[:found])
    return next((i for i, obj in enumerate(objects) if obj is None), found)


def _hashes_of(line: bytes) -> list[int] | None:
    try:
        asked = json.loads(line)
    except ValueError:
        return None
    hashes = asked.get("hashes") if isinstance(asked, dict) else None
    if not isinstance(hashes, list) or len(hashes) > MAX_CHUNKS:
        return None
    if not all(isinstance(h, int) and not isinstance(h, bool) for h in hashes):
        return None
    return hashes


class SocketLookup:
    """The scheduler's side of ``serve_lookups``: one connection, opened when first needed
    and again after a failure."""

    def __init__(self, path: str, timeout: float, backoff: float = LOOKUP_BACKOFF) -> None:
        self.path = path
        self.timeout = timeout
        self.backoff = backoff
        self._sock: socket.socket | None = None
        self._buffered = b""
        self._lines = RepeatLimiter()
        self._quiet_until = 0.0  # time.monotonic() before which lookups are 0 unasked

    def __call__(self, hashes: Sequence[int]) -> int:
        if not hashes or time.monotonic() < self._quiet_until:
            return 0
        try:
            return self._ask(list(hashes))
        except TimeoutError:
            self.close()
            return self._slow()
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self.close()
            if self._lines.admit("lookup") is not None:
                log.warning("kvgate: no lookup answer from the worker (%s): a miss", exc)
            return 0

    def _slow(self) -> int:
        """A lookup that took over the deadline (here or at the worker): a miss, and no
        lookups for ``backoff`` seconds."""
        self._quiet_until = time.monotonic() + self.backoff
        if self._lines.admit("slow") is not None:
            log.warning(
                "kvgate: no lookup answer within %g s (the store or gateway is slow or "
                "down): a miss, and lookups are misses for the next %g s",
                self.timeout,
                self.backoff,
            )
        return 0

    def _ask(self, hashes: list[int]) -> int:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            try:
                sock.connect(self.path)
            except OSError:
                sock.close()
                raise
            self._sock, self._buffered = sock, b""
        self._sock.sendall(json.dumps({"hashes": hashes}).encode() + b"\n")
        while b"\n" not in self._buffered:
            got = self._sock.recv(4096)
            if not got:
                raise ConnectionError("the worker closed the lookup connection")
            self._buffered += got
            if len(self._buffered) > MAX_LINE:
                raise ValueError("a lookup answer too long")
        line, self._buffered = self._buffered.split(b"\n", 1)
        answer = json.loads(line)
        if not isinstance(answer, dict):
            raise ValueError(f"a lookup answer that is not an object: {line[:80]!r}")
        if answer.get("slow") is True:
            return self._slow()
        prefix = answer["prefix"]
        if not isinstance(prefix, int) or not 0 <= prefix <= len(hashes):
            raise ValueError(f"a lookup answer out of range: {prefix!r}")
        return prefix

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
