"""Real memcached servers (Debian's memcached 1.6) on loopback.

``memcached_server``: one session-wide server with room for the conformance suite's 256 MiB
objects (``-m 1024 -I 64m``), shared by tests that each use their own key prefix.
``memcached_factory``: starts function-scoped servers with other flags (the default 1 MiB item
limit, little memory, no eviction) for tests that need them or that kill their server.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from servers.proc import ServerProcess, free_port, port_open, require_binary

_HINT = "apt-get install memcached"
_names = itertools.count()


@dataclass
class MemcachedServer:
    process: ServerProcess
    port: int

    @property
    def url(self) -> str:
        return f"memcached://127.0.0.1:{self.port}"


def start_memcached(
    log_dir: Path, *, memory_mb: int = 1024, item_limit: str = "64m", extra: Sequence[str] = ()
) -> MemcachedServer:
    """A memcached on a free loopback port; ``item_limit`` is its ``-I`` ("" for the default)."""
    binary = require_binary("memcached", _HINT)
    port = free_port()
    argv = [binary, "-l", "127.0.0.1", "-p", str(port), "-U", "0", "-m", str(memory_mb)]
    argv += ["-I", item_limit] if item_limit else []
    if os.geteuid() == 0:
        argv += ["-u", "root"]  # memcached refuses to run as root without it
    argv += list(extra)
    process = ServerProcess(
        argv,
        ready=lambda: port_open(port),
        log_path=log_dir / f"memcached-{port}-{next(_names)}.log",
    )
    return MemcachedServer(process.start(), port)


def stop_memcached(server: MemcachedServer) -> None:
    # memcached keeps nothing on disk, and takes about a second to act on SIGTERM.
    server.process.kill()
    server.process.stop()


@pytest.fixture(scope="session")
def memcached_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL of a session-wide memcached with ``-m 1024 -I 64m``."""
    server = start_memcached(tmp_path_factory.mktemp("memcached"))
    try:
        yield server.url
    finally:
        stop_memcached(server)


@pytest.fixture
def memcached_factory(tmp_path: Path) -> Iterator[Callable[..., MemcachedServer]]:
    """Starts servers for this test only (``start_memcached``'s keywords); stops them all."""
    started: list[MemcachedServer] = []

    def start(
        *, memory_mb: int = 1024, item_limit: str = "64m", extra: Sequence[str] = ()
    ) -> MemcachedServer:
        server = start_memcached(tmp_path, memory_mb=memory_mb, item_limit=item_limit, extra=extra)
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            stop_memcached(server)
