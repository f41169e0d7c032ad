"""The kernel thread pool: chunks all finish, nesting runs inline, and a forked child works."""

from __future__ import annotations

import os
import threading
import time

import pytest

from gpu import dispatch


def test_split_range_covers_everything_once() -> None:
    for n in (1, 2, 3, 7, 100):
        for parts in (1, 2, 3, 8):
            ranges = dispatch.split_range(n, parts)
            assert [i for a, b in ranges for i in range(a, b)] == list(range(n))
            assert all(b > a for a, b in ranges)


def test_run_chunks_waits_for_every_chunk_when_one_fails() -> None:
    done: list[int] = []

    def chunk(start: int, _end: int) -> int:
        if start == 0:
            raise RuntimeError("first chunk fails")
        time.sleep(0.2)
        done.append(start)
        return start

    with pytest.raises(RuntimeError):
        dispatch.run_chunks(chunk, [(0, 1), (1, 2), (2, 3)])
    # The failing call returned only after the others were done writing.
    assert sorted(done) == [1, 2]


def test_run_chunks_inside_a_kernel_thread_runs_inline() -> None:
    threads: set[str] = set()

    def inner(start: int, _end: int) -> int:
        threads.add(threading.current_thread().name)
        return start

    def outer(start: int, _end: int) -> list[int]:
        return dispatch.run_chunks(inner, [(0, 1), (1, 2), (2, 3)])

    # Every pool thread waits on a nested run_chunks: without inline nesting this deadlocks.
    ranges = [(i, i + 1) for i in range(dispatch.cpu_workers() + 1)]
    results = dispatch.run_chunks(outer, ranges)
    assert all(r == [0, 1, 2] for r in results)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_its_own_pool() -> None:
    dispatch.run_chunks(lambda a, b: a, [(0, 1), (1, 2)])  # the parent's pool exists
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            ok = dispatch.run_chunks(lambda a, b: a, [(0, 1), (1, 2), (2, 3)]) == [0, 1, 2]
        finally:
            os._exit(0 if ok else 1)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung on the kernel pool")
