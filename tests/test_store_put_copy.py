"""A put's copy into the pool: whole and checksummed before ``put`` returns, on the loop or in
a CPU thread (from ``OFFLOAD_BYTES`` on)."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch

from gateway import Store
from gateway.errors import InvalidObject
from gateway.tiers import OFFLOAD_BYTES

SIZES = [OFFLOAD_BYTES - 8, OFFLOAD_BYTES, 3 * OFFLOAD_BYTES + 8]


def _config(lower: str, *, l1: bool) -> dict[str, object]:
    tier = {"url": lower, "timeout": 5.0}
    tiers = [{"url": "memory://", "capacity": 64 << 20}, tier] if l1 else [tier]
    return {"tiers": tiers, "staging": 64 << 20}


async def _lower_tier_holds(lower: str, want: np.ndarray) -> None:
    """A new store over the same lower tier reads ``want`` back from it, checksum verified."""
    async with Store(_config(lower, l1=False)) as fresh:
        got = await fresh.get("k")
        assert isinstance(got, torch.Tensor)
        np.testing.assert_array_equal(got.numpy(), want)
        assert not any(s.errors for s in fresh.stats().values())


@pytest.mark.parametrize("l1", [True, False])
@pytest.mark.parametrize("size", SIZES)
async def test_a_buffer_reused_after_put_returns_does_not_change_the_stored_object(
    l1: bool, size: int
) -> None:
    lower = f"memory://{uuid.uuid4().hex}"  # a named space: later stores see it
    buffer = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    want = buffer.copy()
    async with Store(_config(lower, l1=l1)) as store:
        await store.put("k", torch.from_numpy(buffer))
        buffer[:] = 7  # the engine reuses its buffer as soon as put returns
        if l1:
            got = await store.get("k")
            assert isinstance(got, torch.Tensor)
            np.testing.assert_array_equal(got.numpy(), want)
        await store.flush()
    await _lower_tier_holds(lower, want)


async def test_every_put_survives_the_lower_tier_and_reads_back_verified() -> None:
    lower = f"memory://{uuid.uuid4().hex}"
    cfg = {"tiers": [{"url": lower, "timeout": 5.0}], "staging": 64 << 20}
    objs = [
        np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)
        for i, n in enumerate([*SIZES, OFFLOAD_BYTES + 1])
    ]
    async with Store(cfg) as store:
        for i, obj in enumerate(objs):
            await store.put(f"k{i}", obj)
        await store.flush()
        for i, obj in enumerate(objs):
            got = await store.get(f"k{i}")
            assert isinstance(got, np.ndarray)
            np.testing.assert_array_equal(got, obj)
        assert not any(s.errors for s in store.stats().values())


@pytest.mark.parametrize("l1", [True, False])
@pytest.mark.parametrize("size", [4096, 3 * OFFLOAD_BYTES + 8])
async def test_a_staged_put_keeps_the_reserved_memory_and_checksums_it(l1: bool, size: int) -> None:
    """Bytes received into ``reserve``'s slab are stored as they are (the memory tier holds
    that very memory), and lower tiers get them framed with a checksum that verifies."""
    lower = f"memory://{uuid.uuid4().hex}"
    want = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    async with Store(_config(lower, l1=l1)) as store:
        slab = store.reserve(size)
        assert slab is not None
        np.frombuffer(slab.view(), np.uint8)[:] = want  # as a server receives into it
        try:
            await store.put("k", torch.frombuffer(slab.view(), dtype=torch.uint8), staged=slab)
        finally:
            slab.release()
        if l1:
            stored = await store.get_stored("k")
            assert stored is not None
            kept = np.frombuffer(stored.host(), np.uint8)
            assert kept.ctypes.data == np.frombuffer(slab.view(), np.uint8).ctypes.data
            np.testing.assert_array_equal(kept, want)
        await store.flush()
    await _lower_tier_holds(lower, want)


async def test_a_staged_put_of_other_memory_is_refused_and_the_pool_gets_its_slab_back() -> None:
    async with Store(_config(f"memory://{uuid.uuid4().hex}", l1=True)) as store:
        assert store.pool is not None
        before = store.pool.used
        slab = store.reserve(8192)
        assert slab is not None
        elsewhere = torch.zeros(8192, dtype=torch.uint8)
        with pytest.raises(InvalidObject, match="staged slab's bytes"):
            await store.put("k", elsewhere, staged=slab)
        with pytest.raises(InvalidObject, match="staged slab's bytes"):
            await store.put("k", torch.zeros(4096, dtype=torch.uint8), staged=slab)
        slab.release()
        assert store.pool.used == before
        assert await store.get("k") is None
        assert store.reserve(0) is None
        assert store.reserve(store.pool.capacity + 1) is None
