"""``kvgate serve`` in a subprocess, exactly as a user starts it: the console script, its own
event loop choice (uvloop, with the serve extra), its own uvicorn and lm:// server.

The environment is the test's minus every ``KVGATE_*``, ``LMCACHE_*`` and ``AWS_*`` variable (a
developer's own settings must not reach the gateway under test), plus ``PYTHONPATH`` naming
this checkout: the console script then runs this checkout's code even when the venv's editable
install points at another one.
"""

from __future__ import annotations

import os
import signal
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from servers.proc import ServerProcess, free_port, require_binary

ROOT = Path(__file__).resolve().parents[2]
READY_S = 90.0
"""Start-up bound: imports (torch), then prefaulting the pool (2 GiB by default, ~1 s per GiB
on a busy 2-core machine), then /healthz."""
_FOREIGN = ("KVGATE_", "LMCACHE_", "AWS_")


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=0.5) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


@dataclass
class Kvgate:
    """One ``kvgate serve``; ``start`` again after ``kill`` restarts it on the same ports."""

    process: ServerProcess
    port: int
    lm_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process.proc is not None
        return self.process.proc.pid

    def start(self) -> Kvgate:
        self.process.start()
        return self

    def kill(self) -> None:
        """SIGKILL: no shutdown, no flush; what is not on a lower tier yet is gone."""
        self.process.kill()
        self.process.proc = None

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM, as an orchestrator stops a container; the exit status once it is gone
        (``subprocess.TimeoutExpired`` after ``timeout`` s: the caller's teardown kills it)."""
        proc = self.process.proc
        assert proc is not None
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout)
        self.process.proc = None
        return code

    def stop(self) -> None:
        self.process.stop()

    def loaded_libraries(self) -> str:
        """The process's memory map: which shared objects (uvloop's, say) it runs."""
        return Path(f"/proc/{self.pid}/maps").read_text()

    def log(self) -> str:
        return self.process.log_tail(1 << 20)


def kvgate_serve(
    work_dir: Path,
    *,
    config: Path | None = None,
    env: Mapping[str, str] | None = None,
    args: Sequence[str] = (),
) -> Kvgate:
    """A ``kvgate serve --port P --lm-port L [--config FILE] [args]`` (not started) run in
    ``work_dir``, with ``env`` added to the cleaned environment."""
    kvgate = require_binary("kvgate", "pip install -e '.[test]'")
    port, lm_port = free_port(), free_port()
    argv = [kvgate, "serve", "--port", str(port), "--lm-port", str(lm_port)]
    if config is not None:
        argv += ["--config", str(config)]
    argv += args
    clean = {k: v for k, v in os.environ.items() if not k.startswith(_FOREIGN)}
    path = os.pathsep.join(p for p in (str(ROOT), clean.get("PYTHONPATH")) if p)
    process = ServerProcess(
        argv,
        ready=lambda: _healthy(port),
        log_path=work_dir / f"kvgate-{port}.log",
        cwd=work_dir,
        ready_timeout=READY_S,
    )
    process.env = {**clean, "PYTHONPATH": path, **(env or {})}
    return Kvgate(process, port, lm_port)
