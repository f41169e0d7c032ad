"""``benchmarks/put_path.py`` runs end to end against a real server, reports every side and
leaves no keys behind."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import redis
from servers.redis import RedisNode

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "put_path.py"


def test_every_side_is_measured_and_cleaned_up(redis_factory: Callable[..., RedisNode]) -> None:
    server = redis_factory()  # its own server: nothing else's keys to count
    args = ["--size", "64KiB", "-n", "4", "--rounds", "1", "--json"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), server.url, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    report = json.loads(done.stdout)
    assert report["size"] == 64 << 10
    sides = report["sides"]
    assert list(sides) == ["raw", "frame", "frame+hash", "store"]
    for side in sides.values():
        assert len(side["rounds_us"]) == 1
        assert side["us_per_put"] > 0
    assert sides["raw"]["ratio_to_raw"] == 1.0
    assert redis.Redis(host="127.0.0.1", port=server.port).dbsize() == 0


def test_the_url_is_shown_without_its_password(redis_factory: Callable[..., RedisNode]) -> None:
    server = redis_factory(password="S3CRET-pw")
    url = f"redis://:S3CRET-pw@127.0.0.1:{server.port}"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), url, "--size", "4KiB", "-n", "2", "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "S3CRET" not in done.stdout + done.stderr
    assert "store" in done.stdout
