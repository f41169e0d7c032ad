"""gateway.malloc_thresholds: MiB-sized buffers made and freed stop faulting their pages in
again, and a user's own glibc settings are left alone."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from gateway.malloc_thresholds import steady_malloc_thresholds, user_chose_thresholds

glibc_only = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's"
)

# Two 1 MiB bytes made and dropped together, 200 times: page faults per round (in a fresh
# process, so that nothing before it raised glibc's thresholds).
_ROUNDS = """
import json, resource, sys
from gateway.malloc_thresholds import steady_malloc_thresholds
applied = steady_malloc_thresholds() if sys.argv[1] == "on" else False
src = b"s" * (1 << 20)
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for warm in range(20):
    a = src + b"1"; b = src + b"2"; del a, b
before = faults()
for _ in range(200):
    a = src + b"1"; b = src + b"2"; del a, b
print(json.dumps({"applied": applied, "faults": (faults() - before) / 200}))
"""


def _faults_per_round(mode: str, env: dict[str, str] | None = None) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", _ROUNDS, mode],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env=env,
    )
    result: dict[str, float] = json.loads(out.stdout)
    return result


@glibc_only
def test_buffers_freed_together_keep_their_pages() -> None:
    off = _faults_per_round("off")
    on = _faults_per_round("on")
    assert on["applied"]
    assert on["faults"] < 8, on  # 512 pages a round would fault without the thresholds
    if off["faults"] < 100:
        pytest.skip(f"this glibc did not give the memory back by itself: {off}")


@glibc_only
def test_a_users_own_setting_wins() -> None:
    env = {**os.environ, "MALLOC_TRIM_THRESHOLD_": "131072"}
    result = _faults_per_round("on", env)
    assert not result["applied"]


@pytest.mark.parametrize(
    ("env", "chosen"),
    [
        ({}, False),
        ({"KVGATE_MALLOC_THRESHOLDS": "glibc"}, True),
        ({"KVGATE_MALLOC_THRESHOLDS": "off"}, True),
        ({"KVGATE_MALLOC_THRESHOLDS": "kvgate"}, False),
        ({"MALLOC_MMAP_THRESHOLD_": "1048576"}, True),
        ({"MALLOC_TRIM_THRESHOLD_": "0"}, True),
        ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, True),
        ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, False),
    ],
)
def test_who_chose_the_thresholds(env: dict[str, str], chosen: bool) -> None:
    assert user_chose_thresholds(env) is chosen
    if chosen:
        assert steady_malloc_thresholds(env) is False


def test_the_opt_out_is_not_taken_for_a_config_field() -> None:
    from gateway.config import load_config

    load_config(None, env={"KVGATE_MALLOC_THRESHOLDS": "glibc"})
