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


def _run(work_dir: Path, config: Path, args: list[str] | None = None) -> tuple[int, str]:
    """Run ``kvgate serve`` to its end; (exit status, stderr)."""
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
    return done.returncode, done.stderr


def _config(tmp_path: Path, tiers: str) -> Path:
    path = tmp_path / "kvgate.yaml"
    path.write_text(f"prefault: false\ntiers:\n{tiers}")
    return path


async def test_a_disk_tier_directory_in_use_is_one_line_and_status_2(tmp_path: Path) -> None:
    data = tmp_path / "data"
    config = _config(tmp_path, f"  - url: memory://\n    capacity: 16MiB\n  - url: file://{data}\n")
    async with Store({"tiers": [{"url": f"file://{data}"}]}):  # holds the directory's lock
        status, stderr = _run(tmp_path, config)
    assert status == 2, stderr
    assert "Traceback" not in stderr, stderr
    refusal = [line for line in stderr.splitlines() if line.startswith("kvgate serve:")]
    assert len(refusal) == 1, stderr
    assert "not started" in refusal[0]
    assert f"directory {data} is in use" in refusal[0]


def test_a_misspelt_connector_option_is_one_line_and_status_2(tmp_path: Path) -> None:
    """Connectors check their own options as they open (``check_plugins`` does not)."""
    config = _config(
        tmp_path,
        "  - url: memory://\n    capacity: 16MiB\n"
        "  - url: redis://127.0.0.1:1/0\n    options: {socket_timout: 5}\n",
    )
    status, stderr = _run(tmp_path, config)
    assert status == 2, stderr
    assert "Traceback" not in stderr, stderr
    refusal = [line for line in stderr.splitlines() if line.startswith("kvgate serve:")]
    assert len(refusal) == 1, stderr
    assert "option 'socket_timout'" in refusal[0]


def test_an_lm_port_taken_is_one_line_and_status_1(tmp_path: Path) -> None:
    config = _config(tmp_path, "  - url: memory://\n    capacity: 16MiB\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # kvgate_serve passes --lm-port first; argparse-style options take the last value.
        status, stderr = _run(tmp_path, config, ["--lm-port", str(port)])
    assert status == 1, stderr
    assert "Traceback" not in stderr, stderr
    refusal = [line for line in stderr.splitlines() if line.startswith("kvgate serve:")]
    assert len(refusal) == 1, stderr
    assert "address already in use" in refusal[0]
