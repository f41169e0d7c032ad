"""The README's examples, run as written next to a served gateway (issue 15).

The Python example and the curl lines are read from README.md (``tests/readme_blocks.py``), so
the two cannot drift apart. The gateway is ``kvgate serve`` on its embedded default config,
with ``HOME`` pointing at a fresh directory: its disk tier then sits where a ``Store()`` with
no config of the example's would open its own (``~/.local/share/kvgate``), which is how a user
who runs the example next to ``bash .ci/serve`` sees it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from readme_blocks import readme_block
from servers.proc import require_binary

from e2e.serve import ROOT, Kvgate, kvgate_serve

RUN_S = 180.0
"""Bound on one example: torch's import and a small store's start, on a busy 2-core machine."""


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Kvgate, Path]]:
    """A gateway on the default config whose data directory lives under a fresh ``HOME``."""
    root = tmp_path_factory.mktemp("readme")
    home = root / "home"
    home.mkdir()
    gateway = kvgate_serve(root, env={"HOME": str(home), "XDG_DATA_HOME": ""})
    try:
        yield gateway.start(), home
    finally:
        gateway.stop()
        shutil.rmtree(root, ignore_errors=True)


def user_env(gateway: Kvgate, home: Path) -> dict[str, str]:
    """A user's shell next to the gateway: the same ``HOME``, ``KVGATE_URL`` naming it."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("KVGATE_") and k != "XDG_DATA_HOME"
    }
    path = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return {**env, "HOME": str(home), "KVGATE_URL": gateway.url, "PYTHONPATH": path}


def run(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=RUN_S, check=False
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{argv[:2]} still running after {RUN_S} s: {exc.stdout!r} {exc.stderr!r}")


def stored_keys(gateway: Kvgate) -> list[str]:
    listed = httpx.get(f"{gateway.url}/v1/keys", params={"limit": 100}, timeout=30.0)
    listed.raise_for_status()
    return [item["key"] for item in listed.json()["keys"]]


def test_the_python_example_runs_next_to_the_gateway_and_prints_what_it_stored(
    served: tuple[Kvgate, Path], tmp_path: Path
) -> None:
    gateway, home = served
    script = tmp_path / "example.py"
    script.write_text(readme_block("python"))
    result = run([sys.executable, str(script)], user_env(gateway, home), tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == readme_block("python-output")
    assert httpx.get(f"{gateway.url}/healthz", timeout=30.0).status_code == 200
    assert stored_keys(gateway) == []


def test_the_curl_examples_run_against_the_gateway_and_leave_nothing_behind(
    served: tuple[Kvgate, Path], tmp_path: Path
) -> None:
    gateway, home = served
    require_binary("curl", "apt-get install curl")
    lines = readme_block("curl")
    calls = re.findall(r"^\s*(?:.*[;&|]\s*)?(curl\s.*)$", lines, re.M)
    assert len(calls) >= 8, lines
    for call in calls:  # -f: an error status fails the line, and so the test
        assert re.search(r"\s-[a-zA-Z]*f", call), f"curl without -f in README: {call}"
    script = tmp_path / "examples.sh"
    script.write_text("set -euo pipefail\n" + lines)
    work = tmp_path / "cwd"
    work.mkdir()
    result = run(["bash", str(script)], user_env(gateway, home), work)
    assert result.returncode == 0, result.stderr
    assert "hello, kv\n" in result.stdout
    assert "x-kvgate-shape: 2,3" in result.stdout
    promised = re.search(r"^# lookup: (\{.*\})$", lines, re.M)
    assert promised is not None
    assert promised[1] in result.stdout  # the answer the README's comment shows
    assert 'kvgate_tier_puts_total{tier="memory"}' in result.stdout
    assert stored_keys(gateway) == []
    assert list(work.iterdir()) == []
