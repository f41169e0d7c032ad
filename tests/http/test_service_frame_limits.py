"""A frame PUT is bounded by the object it decodes to, not by its compressed size: a 32 KB
zstd frame can hold 1 GiB of zeros. Its header's ``raw_len`` decides the 413, the charge to the
body budget and whether the decode may run on the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from servers.asgi import running
from test_service import FRAME, _entries, _raw_request, _read_status, store_config

from gateway.codec import encode_frame
from gateway.errors import Unavailable
from gateway.http.app import create_app
from gateway.http.byte_budget import ByteBudget
from gateway.objects import to_object_data
from gateway.registry import load_codec
from serde.zstd import ZstdCodec

MIB = 1 << 20
FRAMES = "application/vnd.kvgate.frames"


def zeros_frame(key: str, nbytes: int) -> bytes:
    """A zstd frame of ``nbytes`` zeros: a few hundred bytes whatever ``nbytes``."""
    head, parts, _ = encode_frame(
        load_codec("zstd"), to_object_data(np.zeros(nbytes, np.uint8)), key
    )
    return bytes(head) + b"".join(bytes(p) for p in parts)


@contextlib.contextmanager
def decode_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The threads zstd decodes ran on, in order (every instance: the server's own too)."""
    seen: list[int] = []
    decode: Callable[..., Any] = ZstdCodec.decode

    def recording(self: ZstdCodec, *args: Any) -> Any:
        seen.append(threading.get_ident())
        return decode(self, *args)

    with monkeypatch.context() as patch:
        patch.setattr(ZstdCodec, "decode", recording)
        yield seen


async def test_a_small_frame_of_a_large_object_is_decoded_off_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop_thread = threading.get_ident()  # uvicorn serves on the test's own loop
    app = create_app(store_config(tmp_path), max_body=16 * MIB, body_pool=0)
    small, large = zeros_frame("small", 1024), zeros_frame("large", 8 * MIB)
    assert len(large) < 64 * 1024
    async with running(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
        with decode_threads(monkeypatch) as seen:
            for key, frame in [("small", small), ("large", large), ("small", small)]:
                r = await client.put(
                    f"/v1/objects/{key}", content=frame, headers={"content-type": FRAME}
                )
                assert r.status_code == 204, r.text
        # The first use builds the codec in a thread; once built, a small object's decode is
        # cheap enough for the loop, and the large one's is not, however small its frame.
        assert len(seen) == 3
        assert seen[0] != loop_thread
        assert seen[1] != loop_thread
        assert seen[2] == loop_thread
        got = await client.get("/v1/objects/large")
        assert got.content == bytes(8 * MIB)


async def test_a_frame_of_an_object_over_the_limit_is_413_before_it_is_decoded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = create_app(store_config(tmp_path), max_body=4 * MIB, body_pool=0)
    async with running(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
        with decode_threads(monkeypatch) as seen:
            r = await client.put(
                "/v1/objects/bomb",
                content=zeros_frame("bomb", 5 * MIB),
                headers={"content-type": FRAME},
            )
            batch = _entries([("bomb", zeros_frame("bomb", 5 * MIB))])
            b = await client.post("/v1/batch/put", content=batch, headers={"content-type": FRAMES})
        assert (r.status_code, r.json()["error"]) == (413, "capacity"), r.text
        assert (b.status_code, b.json()["error"]) == (413, "capacity"), b.text
        assert seen == []
        assert (await client.get("/v1/objects/bomb")).status_code == 404


@pytest.mark.parametrize("route", ["object", "batch"])
async def test_the_decoded_object_is_charged_to_the_body_budget(tmp_path: Path, route: str) -> None:
    app = create_app(
        store_config(tmp_path),
        max_body=16 * MIB,
        body_pool=0,
        body_budget=16 * MIB,
        budget_wait=0.3,
    )
    frame = zeros_frame("bomb", 8 * MIB)  # under a kilobyte on the wire
    if route == "object":
        path, content, media = "/v1/objects/bomb", frame, FRAME
    else:
        path, content, media = "/v1/batch/put", _entries([("bomb", frame)]), FRAMES
    async with running(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
        port = int(url.rsplit(":", 1)[1])
        head = (
            b"PUT /v1/objects/slow HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/octet-stream\r\nContent-Length: %d\r\n\r\n" % (12 * MIB)
        )
        # A slow plain upload holds 12 MiB of the 16 while its body trickles in: the frame's
        # 8 MiB object does not fit beside it (its compressed bytes would).
        slow = await asyncio.to_thread(_raw_request, port, head + b"x" * MIB)
        with slow:
            await asyncio.sleep(0.1)
            r = await client.request(
                "PUT" if route == "object" else "POST",
                path,
                content=content,
                headers={"content-type": media},
            )
            assert r.status_code == 503, r.status_code
            assert r.json()["error"] == "unavailable"
            await asyncio.to_thread(slow.sendall, b"x" * (11 * MIB))
            assert await asyncio.to_thread(_read_status, slow) == 204
        r = await client.request(
            "PUT" if route == "object" else "POST",
            path,
            content=content,
            headers={"content-type": media},
        )
        assert r.status_code == 204, r.text
        assert (await client.get("/v1/objects/bomb")).content == bytes(8 * MIB)
        assert app.state.kvgate.body_budget.used == 0


# -- the budget itself -------------------------------------------------------------------


async def test_grow_waits_for_room_and_new_bodies_wait_behind_it() -> None:
    budget = ByteBudget(10, wait=5)
    other = await budget.acquire(6)  # another request, reading its body
    held = await budget.acquire(2)
    growing = asyncio.create_task(budget.grow(4, held))  # 6 + 2 + 4 > 10
    await asyncio.sleep(0.01)
    assert not growing.done()
    # Two bytes are free, but the request that grows holds memory already: the room is its.
    newcomer = asyncio.create_task(budget.acquire(2))
    await asyncio.sleep(0.01)
    assert not newcomer.done()
    budget.release(other)
    assert await growing == 4
    assert await newcomer == 2
    assert budget.used == 8
    budget.release(4)
    budget.release(held)
    budget.release(2)
    assert budget.used == 0
    # Capped so that one request alone always fits: what it holds plus what it grows by.
    assert await ByteBudget(10).grow(100, 7) == 3


async def test_requests_that_all_wait_to_grow_do_not_wait_for_each_other() -> None:
    budget = ByteBudget(10, wait=30)
    first, second = await budget.acquire(4), await budget.acquire(4)
    waiting = asyncio.create_task(budget.grow(4, first))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    # Every byte in use is held by a request waiting to grow: none can give any back, so the
    # first in line gives way, and its body given back lets the second go on.
    second_grows = asyncio.create_task(budget.grow(4, second))
    with pytest.raises(Unavailable, match="busy"):
        await asyncio.wait_for(waiting, 1)
    budget.release(first)
    assert await asyncio.wait_for(second_grows, 1) == 4
    assert budget.used == 8


async def test_a_request_growing_again_and_again_queues_behind_those_waiting() -> None:
    budget = ByteBudget(10, wait=5)
    batch, single = await budget.acquire(2), await budget.acquire(2)
    entry = await budget.grow(6, batch)  # the batch's first entry fits at once
    waiting = asyncio.create_task(budget.grow(6, single))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    budget.release(entry)  # the batch stored its entry, and at once wants room for the next
    next_entry = asyncio.create_task(budget.grow(6, batch))
    assert await asyncio.wait_for(waiting, 1) == 6  # the one that waited goes first
    assert not next_entry.done()
    budget.release(6)
    assert await asyncio.wait_for(next_entry, 1) == 6


async def test_a_batch_holds_one_decoded_entry_while_it_waits_for_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The budget charges one entry's object at a time: the previous one must be gone by
    then, not kept alive (uncharged) while the next waits for room."""
    import gc
    import weakref

    import gateway.http.body as body_module

    decoded: list[weakref.ref[Any]] = []
    alive_at_grow: list[int] = []
    decode = body_module._decode_frame_object
    grow = ByteBudget.grow

    def recording(*args: Any) -> Any:
        obj = decode(*args)
        decoded.append(weakref.ref(obj))
        return obj

    async def counting(self: ByteBudget, nbytes: int, held: int) -> int:
        gc.collect()
        alive_at_grow.append(sum(r() is not None for r in decoded))
        return await grow(self, nbytes, held)

    monkeypatch.setattr(body_module, "_decode_frame_object", recording)
    monkeypatch.setattr(ByteBudget, "grow", counting)
    app = create_app(store_config(tmp_path), max_body=16 * MIB, body_pool=0)
    body = _entries([(f"k{i}", zeros_frame(f"k{i}", 2 * MIB)) for i in range(3)])
    async with running(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
        r = await client.post("/v1/batch/put", content=body, headers={"content-type": FRAMES})
        assert r.status_code == 204, r.text
    assert alive_at_grow == [0, 0, 0]
