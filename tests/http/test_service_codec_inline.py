"""A client's codec options decide where a frame GET's encode runs: zstd at level 22 costs
~0.7 s on a 4 MiB object and must not hold the event loop, whatever the object's size; the
default level stays inline."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from servers.asgi import running
from test_service import FRAME, store_config

from gateway.frame import decode_frame
from gateway.http.app import create_app
from serde.zstd import ZstdCodec

MIB = 1 << 20


def zstd(level: int) -> dict[str, str]:
    options = json.dumps({"level": level})
    return {"accept": FRAME, "x-kvgate-codec": "zstd", "x-kvgate-codec-options": options}


async def test_a_slow_codec_setting_encodes_off_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop_thread = threading.get_ident()  # uvicorn serves on the test's own loop
    seen: list[int] = []
    encode: Callable[..., Any] = ZstdCodec.encode

    def recording(self: ZstdCodec, *args: Any) -> Any:
        seen.append(threading.get_ident())
        return encode(self, *args)

    monkeypatch.setattr(ZstdCodec, "encode", recording)
    app = create_app(store_config(tmp_path), max_body=8 * MIB, body_pool=0)
    rng = np.random.default_rng(0)
    body = rng.standard_normal(2 * MIB // 2 - 64).astype(np.float16).tobytes()  # under 4 MiB
    async with running(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as client:
        headers = {"x-kvgate-dtype": "float16"}
        assert (await client.put("/v1/objects/k", content=body, headers=headers)).status_code == 204
        for level in (3, 22):
            r = await client.get("/v1/objects/k", headers=zstd(level))
            assert r.status_code == 200, r.text
            header, _ = decode_frame(r.content, key="k")
            assert (header.codec, header.params["level"], header.raw_len) == (
                "zstd",
                level,
                len(body),
            )
        assert seen[0] == loop_thread  # level 3: cheap, inline as before
        assert seen[1] != loop_thread  # level 22: ~0.3 s here, in a thread

        # End to end, generously: while level-22 encodes run, the loop still answers at once.
        # (Server and client share this loop: a stall shows as a late turn, asleep or not.)
        async def probe() -> float:
            worst = 0.0
            while not gets.done():
                start = time.perf_counter()
                assert (await client.get("/healthz")).status_code == 200
                await asyncio.sleep(0.01)
                worst = max(worst, time.perf_counter() - start - 0.01)
            return worst

        gets = asyncio.gather(*[client.get("/v1/objects/k", headers=zstd(22)) for _ in range(2)])
        worst = await probe()
        assert [r.status_code for r in await gets] == [200, 200]
        assert worst < 0.5, f"/healthz took {worst:.3f} s while level-22 encodes ran"
