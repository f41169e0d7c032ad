"""The worker side (``gateway.vllm.worker``) on a real Store and synthetic paged caches in
vLLM's CPU layout: saved chunks load back into other blocks, and a chunk that cannot be
loaded is reported block by block (vLLM recomputes those), never half-used."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from gateway.store import Store  # noqa: E402
from gateway.vllm.bridge import StoreThread  # noqa: E402
from gateway.vllm.plan import ChunkMove  # noqa: E402
from gateway.vllm.worker import PagedWorker  # noqa: E402

BLOCKS, LAYERS, SHAPE = 16, 3, (16, 2, 8, 16)  # [blocks, kv_heads, block_size, 2 * head_dim]


def caches(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=gen) for _ in range(LAYERS)]


@pytest.fixture
def bridge(tmp_path: Path) -> Iterator[StoreThread]:
    cfg = {"tiers": [{"url": f"file://{tmp_path / 'disk'}"}], "staging": 16 << 20}
    thread = StoreThread(lambda: Store(cfg), max_pending=16, timeout=10.0)
    thread.start()
    yield thread
    thread.close()


def worker(bridge: StoreThread, seed: int, *, model: str = "m") -> PagedWorker:
    paged = PagedWorker(bridge, model_id=model, world_size=1, rank=0, chunk_size=32)
    paged.register(caches(seed), BLOCKS)
    return paged


def settle(bridge: StoreThread) -> None:
    deadline = time.monotonic() + 10
    while bridge.pending_saves and time.monotonic() < deadline:
        time.sleep(0.01)
    bridge.call(lambda store: store.flush())


def test_saved_chunks_load_into_other_blocks(bridge: StoreThread) -> None:
    source, target = worker(bridge, 1), worker(bridge, 2)
    source.save([ChunkMove(0, 111, (3, 4)), ChunkMove(1, 222, (9, 1))])
    settle(bridge)
    failed = target.load([ChunkMove(0, 111, (0, 5)), ChunkMove(1, 222, (6, 7), skip=1)])
    assert failed == set()
    for src, dst in zip(source.caches, target.caches, strict=True):
        assert torch.equal(dst[0], src[3])
        assert torch.equal(dst[5], src[4])
        assert torch.equal(dst[7], src[1])  # block 6 was vLLM's own (skip)
        assert not torch.equal(dst[6], src[9])


def test_chunks_that_cannot_load_are_reported_and_not_written(bridge: StoreThread) -> None:
    source, target = worker(bridge, 3), worker(bridge, 4)
    source.save([ChunkMove(0, 1, (3, 4))])
    settle(bridge)
    # A tensor of another shape under a chunk's key (written by anything else).
    bridge.call(lambda store: store.put(target.key(2), torch.zeros(2, 2), durable=True))
    before = [c.clone() for c in target.caches]
    failed = target.load(
        [
            ChunkMove(0, 1, (0, 1)),  # loads
            ChunkMove(1, 2, (2, 8)),  # the wrong shape
            ChunkMove(2, 3, (10, 11), skip=1),  # a miss: only block 11 was to be written
        ]
    )
    assert failed == {2, 8, 11}
    assert (target.loaded_chunks, target.failed_chunks) == (1, 2)
    for cache, kept in zip(target.caches, before, strict=True):
        for block in (2, 8, 10, 11):
            assert torch.equal(cache[block], kept[block])
    settle(bridge)  # a tensor of another shape may be another deployment's: kept
    assert bridge.lookup([target.key(1), target.key(2)]) == 2


def test_a_chunk_that_is_not_a_tensor_is_deleted(bridge: StoreThread) -> None:
    """It passed the lookup: left there, every request for its prefix would fail its load,
    and, held, it would never be saved again."""
    target = worker(bridge, 4)
    bridge.call(lambda store: store.put(target.key(5), b"not a chunk", durable=True))
    assert target.load([ChunkMove(0, 5, (0, 1))]) == {0, 1}
    settle(bridge)
    assert bridge.lookup([target.key(5)]) == 0


def test_another_model_or_layout_never_loads_a_chunk(bridge: StoreThread) -> None:
    source = worker(bridge, 5)
    source.save([ChunkMove(0, 7, (1, 2))])
    settle(bridge)
    other_model = worker(bridge, 6, model="other")
    assert other_model.load([ChunkMove(0, 7, (0, 1))]) == {0, 1}
    other_layout = PagedWorker(bridge, model_id="m", world_size=1, rank=0, chunk_size=32)
    other_layout.register([torch.zeros(BLOCKS, 2, 8, 8) for _ in range(LAYERS)], BLOCKS)
    assert other_layout.key(7) != source.key(7)
    assert other_layout.load([ChunkMove(0, 7, (0, 1))]) == {0, 1}


def test_nothing_registered_loads_nothing(bridge: StoreThread) -> None:
    bare = PagedWorker(bridge, model_id="m", world_size=1, rank=0, chunk_size=32)
    assert bare.load([ChunkMove(0, 7, (4, 5), skip=1)]) == {5}
    bare.save([ChunkMove(0, 7, (4, 5))])  # nothing to copy from: nothing saved
    assert bare.saved_chunks == 0
