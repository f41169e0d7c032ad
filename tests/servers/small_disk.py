"""A real filesystem that fills up: a 2 MiB tmpfs, mounted for one test (needs root, i.e.
CAP_SYS_ADMIN; skipped where mounting is not permitted)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["small_disk"]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs: a disk that really fills up. Needs root (CAP_SYS_ADMIN)."""
    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
            capture_output=True,
            text=True,
            check=False,
        )
    except FileNotFoundError:
        pytest.skip("no mount command: cannot make a small disk to fill")
    if done.returncode != 0:
        pytest.skip(f"mounting a 2 MiB tmpfs is not permitted here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
