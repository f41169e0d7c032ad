"""Pages between a paged KV cache and chunk tensors (``gateway.vllm.pages``), in vLLM's CPU
layout (blocks first) and its CUDA layout (K/V first, then blocks), on the CPU and, where there
is one, on a CUDA device."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from gateway.vllm.pages import PagedLayout, gather, scatter  # noqa: E402

BLOCKS, LAYERS = 12, 4
LAYOUTS = {
    "cpu": lambda: (BLOCKS, 3, 16, 32),  # [blocks, kv_heads, block_size, 2 * head_dim]
    "cuda": lambda: (2, BLOCKS, 16, 3, 16),  # [2, blocks, block_size, kv_heads, head_dim]
}
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


def caches(shape: tuple[int, ...], device: str, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(device) for _ in range(LAYERS)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
def test_a_chunk_moves_between_two_caches_block_for_block(layout_name: str, device: str) -> None:
    shape = LAYOUTS[layout_name]()
    src, dst = caches(shape, device, 1), caches(shape, device, 2)
    layout = PagedLayout.of(src, BLOCKS)
    assert layout.block_dim == (0 if layout_name == "cpu" else 1)
    chunk = gather(src, layout, [5, 2, 9])
    before = [d.clone() for d in dst]
    scatter(dst, layout, chunk.cpu(), [0, 7, 3])  # fetched to the host, written on the device
    dim = layout.block_dim
    for s, d, b in zip(src, dst, before, strict=True):
        for from_block, to_block in ((5, 0), (2, 7), (9, 3)):
            assert torch.equal(d.select(dim, to_block), s.select(dim, from_block))
        for untouched in set(range(BLOCKS)) - {0, 7, 3}:
            assert torch.equal(d.select(dim, untouched), b.select(dim, untouched))


def test_gather_copies_so_the_cache_can_change_after() -> None:
    src = caches(LAYOUTS["cpu"](), "cpu", 3)
    layout = PagedLayout.of(src, BLOCKS)
    chunk = gather(src, layout, [1, 2])
    kept = chunk.clone()
    for cache in src:
        cache.zero_()
    assert torch.equal(chunk, kept)


def test_skipped_blocks_are_not_written() -> None:
    src, dst = caches(LAYOUTS["cpu"](), "cpu", 4), caches(LAYOUTS["cpu"](), "cpu", 5)
    layout = PagedLayout.of(src, BLOCKS)
    before = [d.clone() for d in dst]
    scatter(dst, layout, gather(src, layout, [1, 2]), [6, 8], skip=1)
    for s, d, b in zip(src, dst, before, strict=True):
        assert torch.equal(d[6], b[6])  # vLLM's own block, left alone
        assert torch.equal(d[8], s[2])


def test_a_chunk_of_another_layout_is_refused_and_writes_nothing() -> None:
    dst = caches(LAYOUTS["cpu"](), "cpu", 6)
    layout = PagedLayout.of(dst, BLOCKS)
    before = [d.clone() for d in dst]
    other = PagedLayout.of(caches((BLOCKS, 3, 16, 16), "cpu", 7), BLOCKS)
    wrong = [
        gather(caches((BLOCKS, 3, 16, 16), "cpu", 7), other, [1, 2]),  # head dim
        gather(dst, layout, [1, 2]).to(torch.float16),  # dtype
        gather(dst, layout, [1]),  # block count
    ]
    for chunk in wrong:
        with pytest.raises(ValueError, match="expected"):
            scatter(dst, layout, chunk, [3, 4])
    assert all(torch.equal(d, b) for d, b in zip(dst, before, strict=True))
    assert layout.tag() != other.tag()


def test_the_layout_tag_names_device_and_shape() -> None:
    layout = PagedLayout.of(caches(LAYOUTS["cuda"](), "cpu", 8), BLOCKS)
    assert layout.tag() == "cpu:2xBx16x3x16"
    with pytest.raises(ValueError, match="no dimension"):
        PagedLayout.of(caches((5, 3), "cpu", 9), BLOCKS)
