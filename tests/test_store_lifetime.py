"""A closed and dropped Store gives its memory back at once, not at the next cyclic garbage
collection: a process that opens stores in turn (the bench, tests, a service reloading its
configuration) would otherwise hold one pool per closed store until then."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gateway import Store
from gateway.memory import _cuda_available


@pytest.fixture
def no_cyclic_gc() -> Iterator[None]:
    # The first check for CUDA imports torch, and that import leaves the calling frames (and
    # so the first pool being built) in a reference cycle that only the cyclic GC frees: a
    # one-off per process, done here before the GC is turned off.
    _cuda_available()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.parametrize("l1", [True, False], ids=["memory tier", "staging only"])
@pytest.mark.parametrize("prefault", [True, False])
async def test_a_closed_store_frees_its_pool_without_the_cyclic_gc(
    tmp_path: Path, no_cyclic_gc: None, l1: bool, prefault: bool
) -> None:
    tiers = [{"url": "memory://", "capacity": "8MiB"}] if l1 else []
    tiers.append({"url": tmp_path.as_uri()})
    store = Store({"tiers": tiers, "staging": "8MiB", "prefault": prefault})
    async with store:
        await store.put("k", np.arange(1 << 20, dtype=np.uint8))
        await store.flush()
        got = await store.get("k")
        assert got is not None
        del got
    assert store.pool is not None
    pool = weakref.ref(store.pool)
    gone = weakref.ref(store)
    del store
    assert gone() is None, "the closed Store is kept alive by a reference cycle"
    assert pool() is None, "the closed Store's pool is kept alive by a reference cycle"


async def test_an_object_still_held_keeps_its_pool_but_not_the_store(
    tmp_path: Path, no_cyclic_gc: None
) -> None:
    store = Store({"tiers": [{"url": "memory://", "capacity": "8MiB"}]})
    async with store:
        await store.put("k", np.arange(1 << 20, dtype=np.uint8))
        got = await store.get("k")
    assert store.pool is not None
    pool = weakref.ref(store.pool)
    gone = weakref.ref(store)
    del store
    assert gone() is None
    assert pool() is not None  # the lease on the object's slab
    assert isinstance(got, np.ndarray)
    assert int(got[1000]) == 1000 % 256
    del got
    assert pool() is None
