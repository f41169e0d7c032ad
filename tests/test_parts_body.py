"""``PartsBody``: what aiohttp is handed to send (``connectors.parts_body``)."""

from __future__ import annotations

import os

import pytest

from connectors.parts_body import FIRST_SLICE, SLICE, PartsBody


class Recorder:
    """The part of aiohttp's stream writer a payload writes to: keeps every write."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    async def write(self, chunk: memoryview | bytes) -> None:
        self.writes.append(bytes(chunk))


@pytest.mark.parametrize(
    "sizes",
    [(10,), (FIRST_SLICE,), (100, 5 * SLICE + 3, 7), (0, 3 * SLICE), (SLICE + 1, 0, SLICE)],
)
async def test_bodies_go_out_whole_in_bounded_writes(sizes: tuple[int, ...]) -> None:
    pieces = [os.urandom(n) for n in sizes]
    out = Recorder()
    await PartsBody([memoryview(p) for p in pieces]).write(out)  # type: ignore[arg-type]
    assert b"".join(out.writes) == b"".join(pieces)
    # aiohttp joins the first write with the headers: it is small; none is over SLICE.
    assert len(out.writes[0]) <= FIRST_SLICE
    assert max(len(w) for w in out.writes) <= SLICE
    assert all(out.writes)


async def test_a_content_length_clips_the_body_and_each_sending_starts_small() -> None:
    data = os.urandom(3 * SLICE)
    body = PartsBody([memoryview(data)])
    for _ in range(2):  # a retried request sends the body again, from its start
        out = Recorder()
        await body.write_with_length(out, 2 * SLICE + 5)  # type: ignore[arg-type]
        assert b"".join(out.writes) == data[: 2 * SLICE + 5]
        assert len(out.writes[0]) == FIRST_SLICE
