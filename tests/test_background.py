"""gateway.background: a Store's write-behind runs below the CPU priority of what it serves."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gateway.background import (
    BACKGROUND_NICE,
    is_write_behind,
    low_priority_threads,
    pool_for,
    write_behind,
)

ROOT = Path(__file__).resolve().parents[1]
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice")


def thread_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@linux_only
def test_low_priority_threads_run_at_a_higher_nice_value_than_the_process() -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    with low_priority_threads(1, "test-behind") as pool:
        assert pool.submit(thread_nice).result() == min(19, base + BACKGROUND_NICE)
    assert thread_nice() == base  # the caller's thread is left as it was
    with ThreadPoolExecutor(1) as plain:
        assert plain.submit(thread_nice).result() == base


async def test_the_write_behind_mark_stays_in_the_task_that_set_it() -> None:
    foreground, background = object(), object()

    async def writer() -> tuple[bool, object]:
        write_behind()
        await asyncio.sleep(0)
        return is_write_behind(), pool_for(foreground, background)  # type: ignore[arg-type]

    assert await asyncio.create_task(writer()) == (True, background)
    assert not is_write_behind()  # the caller's context never saw the mark
    assert pool_for(foreground, background) is foreground  # type: ignore[arg-type]


# Run in a fresh interpreter, so that the file tier's thread pools hold only the threads this
# script's puts made. Prints each live thread's name and nice value.
SCRIPT = """
import asyncio, json, os, sys, threading
from gateway.store import Store

async def main(tiers, durable):
    async with Store({"tiers": tiers, "prefault": False}) as store:
        for i in range(3):
            await store.put(f"m@1@0@{i:x}@uint8", os.urandom(1 << 20), durable=durable)
        await store.flush()
        assert await store.get(f"m@1@0@{2:x}@uint8") is not None
        return {t.name: os.getpriority(os.PRIO_PROCESS, t.native_id)
                for t in threading.enumerate() if t.native_id is not None}

print(json.dumps(asyncio.run(main(json.loads(sys.argv[1]), sys.argv[2] == "durable"))))
"""


def threads_after_puts(tmp_path: Path, tiers: list[dict[str, object]], mode: str) -> dict[str, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVGATE_", "LMCACHE_"))}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(tiers), mode],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


@linux_only
def test_write_back_to_a_file_tier_runs_at_the_lower_priority(tmp_path: Path) -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    tiers = [{"url": "memory://", "capacity": 64 << 20}, {"url": f"file://{tmp_path}"}]
    threads = threads_after_puts(tmp_path, tiers, "write-back")
    behind = {name: nice for name, nice in threads.items() if name.startswith("kvgate-fs-behind")}
    assert behind, f"no write-behind thread wrote the file tier: {sorted(threads)}"
    assert set(behind.values()) == {min(19, base + BACKGROUND_NICE)}
    assert len(list(tmp_path.rglob("*"))) > 0  # and the tier holds the objects


@linux_only
def test_puts_that_wait_for_the_file_tier_keep_the_normal_priority(tmp_path: Path) -> None:
    tiers = [{"url": "memory://", "capacity": 64 << 20}, {"url": f"file://{tmp_path}"}]
    threads = threads_after_puts(tmp_path, tiers, "durable")
    assert not [n for n in threads if n.startswith("kvgate-fs-behind")]
    assert [n for n in threads if n.startswith("kvgate-fs_")]  # the normal pool wrote them
