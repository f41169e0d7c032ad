"""Real servers for the tests: start a binary on loopback, wait until it answers, stop it.

Every backend fixture (``tests/servers/<backend>.py``) is built on ``ServerProcess``. A server
whose binary is missing skips its tests on a developer machine and FAILS them in CI
(``CI`` set in the environment), where ``.ci/setup`` must have installed it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

_used_ports: set[int] = set()


def in_ci() -> bool:
    return bool(os.environ.get("CI"))


def require_binary(name: str, hint: str) -> str:
    """The path of ``name`` on PATH (or the venv); skip locally, fail in CI, when absent."""
    venv_bin = Path(sys.executable).parent
    found = shutil.which(name) or shutil.which(name, path=str(venv_bin))
    if found:
        return found
    message = f"{name} is not installed ({hint})"
    if in_ci():
        pytest.fail(message)
    pytest.skip(message)


def free_port(also_free: Sequence[int] = ()) -> int:
    """A loopback TCP port that is free now, and whose ``port + offset`` are free too.

    Redis Cluster needs ``port + 10000`` (its bus) and SeaweedFS needs ``port + 10000`` (gRPC),
    so callers pass ``also_free=(10000,)``. Ports handed out once are not handed out again in
    this process, so two fixtures never race for the same one.
    """
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port in _used_ports or port + max(also_free, default=0) > 65535:
            continue
        if all(_port_is_free(port + off) for off in also_free):
            _used_ports.add(port)
            _used_ports.update(port + off for off in also_free)
            return port
    raise RuntimeError("no free loopback port")


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


class ServerProcess:
    """One server process: ``start()`` runs ``argv`` and waits for ``ready()``; ``stop()`` ends it.

    ``kill()`` (SIGKILL, no clean shutdown) and a later ``start()`` with the same argv are what
    the fault tests use to take a backend away and bring it back on the same address.
    Output goes to ``log_path`` so a failed start can say why.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        ready: Callable[[], bool],
        log_path: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        ready_timeout: float = 30.0,
    ) -> None:
        self.argv = list(argv)
        self.ready = ready
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.cwd = cwd
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,  # its own process group: stop() reaps its children too
            )
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.argv[0]} exited at start:\n{self.log_tail()}")
            if self.ready():
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"{self.argv[0]} not ready in {self.ready_timeout}s:\n{self.log_tail()}")

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole process group: the server vanishes mid-request."""
        self._signal(signal.SIGKILL)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The server stalled for the block (SIGSTOP: the kernel still accepts connections,
        nothing answers), resumed (SIGCONT) when it ends, whatever happens."""
        self._signal(signal.SIGSTOP)
        try:
            yield
        finally:
            self._signal(signal.SIGCONT)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None:
            return
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.proc.wait(timeout)
        self.proc = None

    def _signal(self, sig: int) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        if sig == signal.SIGKILL:
            self.proc.wait()

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return "(no log)"
