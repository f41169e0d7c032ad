"""``kvgate serve`` as shipped, refusing to start for a reason found only while it starts: it
says why in one line and exits, with no traceback (a config error with status 2, as the
refusals found before the start are; a port taken with 1)."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

from e2e.serve import kvgate_serve
from gateway import Store

RUN_S = 90.0  # imports (torch) on a busy machine, then the refused start


def _refusal(work_dir: Path, config: Path, status: int, args: list[str] | None = None) -> str:
    """Run ``kvgate serve`` to its end; check it exits with ``status`` and one line saying why,
    no traceback; that line."""
    serve = kvgate_serve(work_dir, config=config, args=args or [])
    done = subprocess.run(
        serve.process.argv,
        env=serve.process.env,
        cwd=work_dir,
        capture_output=True,
        text=True,
        timeout=RUN_S,
        check=False,
    )
    assert done.returncode == status, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    refusal = [line for line in done.stderr.splitlines() if line.startswith("kvgate serve:")]
    assert len(refusal) == 1, done.stderr
    assert refusal[0].startswith("kvgate serve: not started: ")
    return refusal[0]


def _config(tmp_path: Path, tiers: str) -> Path:
    path = tmp_path / "kvgate.yaml"
    path.write_text(f"prefault: false\ntiers:\n{tiers}")
    return path


async def test_a_disk_tier_directory_in_use_is_one_line_and_status_2(tmp_path: Path) -> None:
    data = tmp_path / "data"
    config = _config(tmp_path, f"  - url: memory://\n    capacity: 16MiB\n  - url: file://{data}\n")
    async with Store({"tiers": [{"url": f"file://{data}"}]}):  # holds the directory's lock
        refusal = _refusal(tmp_path, config, 2)
    assert f"directory {data} is in use" in refusal


def test_a_misspelt_connector_option_is_one_line_and_status_2(tmp_path: Path) -> None:
    """Connectors check their own options as they open (``check_plugins`` does not)."""
    config = _config(
        tmp_path,
        "  - url: memory://\n    capacity: 16MiB\n"
        "  - url: redis://127.0.0.1:1/0\n    options: {socket_timout: 5}\n",
    )
    assert "option 'socket_timout'" in _refusal(tmp_path, config, 2)


def test_an_lm_port_taken_is_one_line_and_status_1(tmp_path: Path) -> None:
    config = _config(tmp_path, "  - url: memory://\n    capacity: 16MiB\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # kvgate_serve passes --lm-port first; argparse-style options take the last value.
        refusal = _refusal(tmp_path, config, 1, ["--lm-port", str(port)])
    assert "address already in use" in refusal
