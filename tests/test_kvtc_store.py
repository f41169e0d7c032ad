"""``kvtc`` frames in a Store: the calibration travels in the tiers, by hash.

A reader that never saw the calibration (registry cleared, or a new process) fetches it from
the tier holding the frame; a missing or altered calibration makes the frame a counted miss,
never a wrong tensor, and the frame is kept (it is sound)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from kvtc_data import ROPE, calibration_chunks, correlated_kv
from servers.asgi import serve

from gateway import Store
from gateway.codec import encode_frame
from gateway.frame import decode_frame
from gateway.http.app import create_app
from gateway.http.batch import entry_head
from gateway.objects import to_object_data
from gateway.registry import connect, load_codec
from gateway.types import MemoryFormat
from serde.kvtc import registry
from serde.kvtc.fit import fit

F = MemoryFormat


@pytest.fixture(scope="module")
def cal_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    loaded = fit(calibration_chunks(4), group=2, rel_error=0.03, rope=ROPE)
    path = tmp_path_factory.mktemp("cal") / "model.kvtc"
    path.write_bytes(loaded.data)
    return path, loaded.sha256


def config(root: Path, codec: str = "kvtc", **options: Any) -> dict[str, Any]:
    tier = {"url": f"file://{root}", "codec": codec, "codec_options": options}
    return {"tiers": [tier], "staging": 16 << 20}


def side_key(sha: str) -> str:
    return registry.key_of(sha)


def close_to(got: object, src: torch.Tensor) -> bool:
    assert isinstance(got, torch.Tensor)
    err = (got.float() - src.float()).norm() / src.float().norm()
    return bool(got.shape == src.shape and err < 0.06)


async def write(root: Path, cal: Path, chunks: dict[str, tuple[torch.Tensor, int]]) -> None:
    async with Store(config(root, calibration=str(cal))) as store:
        for key, (kv, pos) in chunks.items():
            await store.put(key, kv, fmt=F.KV_2LTD, position=pos)


CHUNKS = {f"chunk{i}": (correlated_kv(64, 64 * i, seed=50 + i), 64 * i) for i in range(3)}


async def test_a_fresh_store_fetches_the_calibration(
    tmp_path: Path, cal_file: tuple[Path, str]
) -> None:
    await write(tmp_path, cal_file[0], CHUNKS)
    registry.forget_all()
    async with Store(config(tmp_path, "raw")) as store:
        for key, (kv, _) in CHUNKS.items():
            assert close_to(await store.get(key), kv)
        assert store.stats()["file"].corrupt == 0
    assert registry.lookup(cal_file[1]) is not None  # kept for the next frames


async def test_missing_calibration_is_a_counted_miss_and_keeps_the_frame(
    tmp_path: Path, cal_file: tuple[Path, str]
) -> None:
    await write(tmp_path, cal_file[0], CHUNKS)
    registry.forget_all()
    async with Store(config(tmp_path, "raw")) as store:
        assert await store.delete(side_key(cal_file[1]))
        assert await store.get("chunk0") is None
        assert store.stats()["file"].corrupt == 1
        # Not discarded (someone may have the calibration), but not looked up as stored here.
        assert await store.tiers[0].connector.exists("chunk0")
        assert not await store.contains("chunk0")
    # A writer puts the calibration again (with its next frame): the old frames read back.
    await write(tmp_path, cal_file[0], {"other": CHUNKS["chunk1"]})
    registry.forget_all()
    async with Store(config(tmp_path, "raw")) as store:
        assert close_to(await store.get("chunk0"), CHUNKS["chunk0"][0])


async def test_altered_or_other_calibration_is_a_miss(
    tmp_path: Path, cal_file: tuple[Path, str]
) -> None:
    await write(tmp_path, cal_file[0], CHUNKS)
    other = fit(calibration_chunks(4), group=1, rel_error=0.05, rope=ROPE)
    registry.forget_all()
    raw = cal_file[0].read_bytes()
    for replacement in (other.data, raw[:-1] + bytes([raw[-1] ^ 1]), b"not a calibration"):
        async with Store(config(tmp_path, "raw")) as store:
            await store.put(side_key(cal_file[1]), replacement)
        async with Store(config(tmp_path, "raw")) as store:
            assert await store.get("chunk2") is None
            assert store.stats()["file"].corrupt == 1
        assert registry.lookup(cal_file[1]) is None


async def test_position_is_optional(tmp_path: Path, cal_file: tuple[Path, str]) -> None:
    kv = correlated_kv(64, 640, seed=77)
    async with Store(config(tmp_path, calibration=str(cal_file[0]))) as store:
        await store.put("with", kv, fmt=F.KV_2LTD, position=640)
        await store.put("without", kv, fmt=F.KV_2LTD)
        for bad in (-1, 10**18, True, 1.5):  # 10**18: one digit over what HTTP carries
            with pytest.raises(ValueError, match="position"):
                await store.put("bad", kv, fmt=F.KV_2LTD, position=bad)  # type: ignore[arg-type]
    registry.forget_all()
    async with Store(config(tmp_path, "raw")) as store:
        assert close_to(await store.get("with"), kv)
        assert close_to(await store.get("without"), kv)


def test_a_new_process_reads_kvtc_frames(tmp_path: Path, cal_file: tuple[Path, str]) -> None:
    import asyncio

    asyncio.run(write(tmp_path, cal_file[0], CHUNKS))
    torch.save(CHUNKS["chunk1"][0], tmp_path.parent / "expected.pt")
    script = textwrap.dedent(
        f"""
        import asyncio, torch
        from gateway import Store
        from serde.kvtc import registry

        async def main():
            tier = {{"url": "file://{tmp_path}", "codec": "zstd"}}
            async with Store({{"tiers": [tier]}}) as store:
                got = await store.get("chunk1")
                assert registry.lookup("{cal_file[1]}") is not None
                want = torch.load("{tmp_path.parent / "expected.pt"}")
                err = (got.float() - want.float()).norm() / want.float().norm()
                print("ERR", float(err), store.stats()["file"].corrupt)

        asyncio.run(main())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    _, err, corrupt = done.stdout.split()
    assert float(err) < 0.06
    assert corrupt == "0"


async def test_kvtc_in_a_codec_chain(tmp_path: Path, cal_file: tuple[Path, str]) -> None:
    """kvtc first in a chain: the tier still writes its calibration, and a fresh reader
    fetches it when the chain's kvtc stage asks."""
    tier = {
        "url": f"file://{tmp_path}",
        "codec": ["kvtc", "zstd"],
        "codec_options": [{"calibration": str(cal_file[0])}, {}],
    }
    kv = correlated_kv(64, 128, seed=88)
    async with Store({"tiers": [tier]}) as store:
        await store.put("chained", kv, fmt=F.KV_2LTD, position=128)
    registry.forget_all()
    async with Store(config(tmp_path, "raw")) as store:
        assert close_to(await store.get("chained"), kv)
        assert store.stats()["file"].corrupt == 0


# -- the start position reaches the codec from every way in ---------------------------------


async def stored_position(root: Path, key: str) -> int | None:
    """The start position the frame under ``key`` in the file tier at ``root`` records."""
    conn = connect(f"file://{root}")
    try:
        blob = await conn.get(key)
    finally:
        await conn.close()
    assert blob is not None, f"no frame under {key!r}"
    header, _ = decode_frame(blob)
    assert header.codec == "kvtc"
    pos = header.params.get("pos")
    assert pos is None or isinstance(pos, int)
    return pos


async def test_put_many_passes_each_items_position(
    tmp_path: Path, cal_file: tuple[Path, str]
) -> None:
    chunks = [(f"many{i}", correlated_kv(64, 64 * i, seed=60 + i)) for i in range(3)]
    async with Store(config(tmp_path, calibration=str(cal_file[0]))) as store:
        await store.put_many(chunks, fmt=F.KV_2LTD, positions=[0, 64, None])
        with pytest.raises(ValueError, match="3 items but 2 positions"):
            await store.put_many(chunks, fmt=F.KV_2LTD, positions=[0, 64])
    assert [await stored_position(tmp_path, key) for key, _ in chunks] == [0, 64, None]


async def test_the_http_position_header_reaches_the_codec(
    tmp_path: Path, cal_file: tuple[Path, str]
) -> None:
    kv = correlated_kv(64, 320, seed=70)
    head = {"x-kvgate-kind": "tensor", "x-kvgate-dtype": "float16", "x-kvgate-format": "1"}
    head["x-kvgate-shape"] = ",".join(map(str, kv.shape))
    body = kv.numpy().tobytes()
    app = create_app(config(tmp_path, calibration=str(cal_file[0])))
    async for url in serve(app):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            for key, extra in (("at320", {"x-kvgate-position": "320"}), ("unknown", {})):
                put = await client.put(f"/v1/objects/{key}", content=body, headers=head | extra)
                assert put.status_code == 204, put.text
            for bad in ("-1", "1.5", "x", "0x10", "1" * 40):
                put = await client.put(
                    "/v1/objects/bad", content=body, headers=head | {"x-kvgate-position": bad}
                )
                assert put.status_code == 400, bad
                assert "x-kvgate-position" in put.json()["detail"]
            assert (await client.post("/v1/flush")).status_code < 300
    assert await stored_position(tmp_path, "at320") == 320
    assert await stored_position(tmp_path, "unknown") is None


async def test_the_batch_put_positions_reach_the_codec(
    tmp_path: Path, cal_file: tuple[Path, str]
) -> None:
    """``x-kvgate-positions``: one item per batch entry, in order; an empty item is unknown."""
    chunks = [(f"batch{i}", correlated_kv(64, 128 * i, seed=80 + i)) for i in range(3)]
    body = b""
    for key, kv in chunks:
        head, parts, _ = encode_frame(load_codec("raw"), to_object_data(kv, F.KV_2LTD), key)
        frame = head + b"".join(bytes(p) for p in parts)
        body += entry_head(key, len(frame)) + frame
    frames = {"content-type": "application/vnd.kvgate.frames"}
    app = create_app(config(tmp_path, calibration=str(cal_file[0])))
    async for url in serve(app):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            for bad, says in (("0,128", "2 items for 3"), ("0,,x", "item 2"), ("0,1,2,3", "4")):
                put = await client.post(
                    "/v1/batch/put", content=body, headers=frames | {"x-kvgate-positions": bad}
                )
                assert put.status_code == 400, bad
                assert "x-kvgate-positions" in put.json()["detail"]
                assert says in put.json()["detail"]
            put = await client.post(
                "/v1/batch/put", content=body, headers=frames | {"x-kvgate-positions": "0, ,256"}
            )
            assert put.status_code == 204, put.text
            assert (await client.post("/v1/flush")).status_code < 300
    assert [await stored_position(tmp_path, key) for key, _ in chunks] == [0, None, 256]


@pytest.mark.parametrize("durable", [False, True])
async def test_a_gateway_tier_passes_the_position_to_the_remotes_codec(
    tmp_path: Path, cal_file: tuple[Path, str], durable: bool
) -> None:
    """A chained kvgate: this store's gateway:// tier sends raw frames, and the remote encodes
    them with its own kvtc tier, which needs each chunk's position to undo RoPE."""
    kv = correlated_kv(64, 448, seed=71)
    remote = create_app(config(tmp_path, calibration=str(cal_file[0])))
    async for url in serve(remote):
        # One write worker: a position left set by one write would reach the next.
        tier = {"url": url.replace("http://", "gateway://"), "workers": 1}
        local = {"tiers": [tier], "staging": 16 << 20}
        async with Store(local) as store:
            await store.put("at448", kv, fmt=F.KV_2LTD, position=448, durable=durable)
            await store.put("unknown", kv, fmt=F.KV_2LTD, durable=durable)
            await store.flush()
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            assert (await client.post("/v1/flush")).status_code < 300
    assert await stored_position(tmp_path, "at448") == 448
    assert await stored_position(tmp_path, "unknown") is None


@pytest.mark.parametrize("position", [0, 2**40, 2**40 + 1, 10**18 - 1])
async def test_every_position_a_store_takes_round_trips(
    tmp_path: Path, cal_file: tuple[Path, str], position: int
) -> None:
    """Up to 2**40 keys have RoPE undone at their positions; above, where float64 angles no
    longer undo the model's rotation, they are coded as stored, and read back all the same."""
    kv = correlated_kv(48, position, seed=91)
    async with Store(config(tmp_path, calibration=str(cal_file[0]))) as store:
        await store.put("chunk", kv, fmt=F.KV_2LTD, position=position, durable=True)
    assert await stored_position(tmp_path, "chunk") == position
    conn = connect(f"file://{tmp_path}")
    try:
        blob = await conn.get("chunk")
    finally:
        await conn.close()
    assert blob is not None
    assert ("theta" in decode_frame(blob)[0].params) == (position <= 2**40)
    registry.forget_all()
    async with Store(config(tmp_path, "raw")) as store:
        assert close_to(await store.get("chunk"), kv)
        assert store.stats()["file"].corrupt == 0
