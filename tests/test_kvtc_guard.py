"""``kvtc`` on chunks unlike its calibration (``serde.kvtc.guard``): such chunks are coded by
``cachegen`` and come back within the codec's documented error, never as the calibration's
mean or an error many times the chunk; chunks like the calibration stay ``kvtc``-coded. The
guard's error, computed without reconstructing, is the decoder's error."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from kvtc_data import CHANNELS, LAYERS, ROPE, calibration_chunks, correlated_kv

from gateway import Store
from gateway.codec import encode_frame
from gateway.frame import FrameInfo, decode_frame
from gateway.objects import to_object_data
from gateway.types import MemoryFormat
from serde.kvtc import guard, host, registry
from serde.kvtc.calibration import Loaded
from serde.kvtc.codec import KvtcCodec
from serde.kvtc.fit import fit

F = MemoryFormat
POSITION = 256  # past the sinks: every token is coded


@pytest.fixture(scope="module")
def plain() -> Loaded:
    loaded = fit(calibration_chunks(), group=2, rel_error=0.03, rope=ROPE, note="guard")
    registry.register(loaded.data)
    return loaded


@pytest.fixture(scope="module")
def weighted() -> Loaded:
    keys = np.ones((LAYERS, CHANNELS))
    keys[:, : CHANNELS // 2] = 50.0
    values = np.ones((LAYERS, CHANNELS))
    values[LAYERS - 1] = 1e-6  # a layer the model hardly reads
    loaded = fit(calibration_chunks(), rel_error=0.05, rope=ROPE, weights=[keys, values, keys])
    registry.register(loaded.data)
    return loaded


@pytest.fixture(scope="module")
def shared() -> Loaded:
    """Keys dear, values cheap, one step for both (what ``kvgate calibrate --weights`` makes):
    the step leaves the values with far more of their energy in error than the keys."""
    keys = np.full((LAYERS, CHANNELS), 100.0)
    values = np.ones((LAYERS, CHANNELS))
    loaded = fit(
        calibration_chunks(),
        rel_error=0.05,
        rope=ROPE,
        weights=[keys, values, keys],
        shared_step=True,
    )
    registry.register(loaded.data)
    return loaded


def round_trip(
    codec: KvtcCodec, src: torch.Tensor, position: int = POSITION
) -> tuple[torch.Tensor, FrameInfo]:
    data = to_object_data(src, fmt=F.KV_2LTD)
    data.position = position
    head, parts, _ = encode_frame(codec, data)
    header, body = decode_frame(head + b"".join(bytes(p) for p in parts))
    raw = codec.decode(body, header, memoryview(bytearray(header.raw_len)))
    return torch.frombuffer(bytearray(raw), dtype=src.dtype).reshape(src.shape), header


def plane_errors(src: torch.Tensor, got: torch.Tensor) -> list[float]:
    errors = []
    for p in (0, 1):
        diff = float((got[p].float() - src[p].float()).norm())
        norm = float(src[p].float().norm())
        errors.append(diff / norm if norm else (0.0 if diff == 0 else float("inf")))
    return errors


def like() -> torch.Tensor:
    return correlated_kv(96, POSITION, seed=7)


UNLIKE: dict[str, Callable[[], torch.Tensor]] = {
    "zeros": lambda: torch.zeros_like(like()),
    "scaled by 1e-3": lambda: (like().float() * 1e-3).half(),
    "scaled by 0.1": lambda: (like().float() * 0.1).half(),
    "scaled by 10": lambda: (like().float() * 10).half(),
    "offset by 5": lambda: (like().float() + 5).half(),
    "another model": lambda: torch.randn(
        like().shape, generator=torch.Generator().manual_seed(3)
    ).half(),
}


@pytest.mark.parametrize("make", UNLIKE.values(), ids=UNLIKE.keys())
@pytest.mark.parametrize("which", ["plain", "weighted", "shared"])
def test_a_chunk_unlike_the_calibration_comes_back_within_the_documented_error(
    make: Callable[[], torch.Tensor], which: str, request: pytest.FixtureRequest
) -> None:
    loaded: Loaded = request.getfixturevalue(which)
    codec = KvtcCodec(calibration=loaded.sha256)
    src = make()
    got, header = round_trip(codec, src)
    assert header.params.get("via") == "cachegen"
    assert max(plane_errors(src, got)) <= codec.documented_rel_error


@pytest.mark.parametrize("tokens", [96, 8, 1])
@pytest.mark.parametrize("which", ["plain", "weighted", "shared"])
def test_a_chunk_like_the_calibration_is_coded_by_it(
    which: str, tokens: int, request: pytest.FixtureRequest
) -> None:
    loaded: Loaded = request.getfixturevalue(which)
    codec = KvtcCodec(calibration=loaded.sha256)
    for start in range(0, 96 - tokens + 1, max(tokens, 12)):
        src = correlated_kv(tokens, POSITION + start, seed=7 + start)
        got, header = round_trip(codec, src, POSITION + start)
        assert "via" not in header.params
        assert header.params["cal"] == loaded.sha256
        if which == "plain" and tokens > 1:  # weights spend the error where they are low
            assert max(plane_errors(src, got)) < 0.06


def test_a_shared_step_calibration_leaves_most_error_on_the_cheap_plane(shared: Loaded) -> None:
    """Why such calibrations are judged on both planes together: the values alone are over
    the bound on data the calibration was fitted to, and the chunk must still be kvtc's."""
    from serde.kvtc.codec import _coefficients_host

    coded = _coefficients_host(shared, (0, 1), like().float(), ROPE, POSITION)
    assert coded is not None
    keys, values = ((sum(e for e, _ in p) / sum(f for _, f in p)) ** 0.5 for p in coded[1])
    assert values > guard.UNLIKE > 5 * keys
    assert not guard.unlike(coded[1], joint=True)
    assert guard.unlike(coded[1], joint=False)


def test_sums_that_overflow_store_the_chunk_verbatim(weighted: Loaded) -> None:
    """float32 sums of a bfloat16 chunk near 1e22 are infinite (error and energy alike, which
    compared as "fine"): such a chunk is stored exactly, not coded with its values lost."""
    src = like().to(torch.bfloat16)
    src[1, LAYERS - 1, 10:20] = 1e22
    got, header = round_trip(KvtcCodec(calibration=weighted.sha256), src)
    assert header.params == {"mode": "raw"}
    assert torch.equal(got.view(torch.int16), src.view(torch.int16))


@pytest.mark.parametrize("scale", [1.0, 2.0, 10.0])
@pytest.mark.parametrize("plane", [0, 1, 2], ids=["keys", "values", "post-RoPE keys"])
@pytest.mark.parametrize("which", ["plain", "weighted", "shared"])
def test_the_guard_error_is_the_decoders_error(
    scale: float, plane: int, which: str, request: pytest.FixtureRequest
) -> None:
    """Per group, in the calibration's metric: the formula against a reconstruction (any
    features of a group's width will do: the formula does not care where they came from)."""
    loaded: Loaded = request.getfixturevalue(which)
    kv = correlated_kv(64, POSITION, seed=11).float().numpy() * scale
    data = kv[min(plane, 1)]
    groups = loaded.arrays(torch.device("cpu"))[plane]
    first = 0
    for (start, count), dev in zip(loaded.cal.group_layers(plane), groups, strict=True):
        assert start == first
        first += count
        x = np.ascontiguousarray(data[start : start + count].transpose(1, 0, 2)).reshape(64, -1)
        q = np.empty((dev.encode.shape[0], 64), np.int32)
        error, energy = host.coefficients(x, dev, q)
        x_hat = host.reconstruct(q.astype(np.float32), dev)
        s = np.ones(x.shape[1], np.float32) if dev.scale is None else dev.scale.numpy()
        assert energy == pytest.approx(float(((s * x) ** 2).sum()), rel=1e-4)
        measured = float(((s * (x - x_hat)) ** 2).sum())
        # Exact up to float32 sums, a float32 reconstruction and the float16 basis: within 2%,
        # or within 5e-4 of the energy where the error itself is tiny (0.25^2 is the bound).
        assert error == pytest.approx(measured, rel=0.02, abs=5e-4 * energy)


def test_the_guard_bound_sits_between_like_and_unlike(plain: Loaded) -> None:
    def relative(src: torch.Tensor) -> float:
        from serde.kvtc.codec import _coefficients_host

        coded = _coefficients_host(plain, (0, 1), src.float(), ROPE, POSITION)
        assert coded is not None
        planes = [sum(e for e, _ in p) / sum(f for _, f in p) for p in coded[1]]
        return float(max(planes) ** 0.5)

    assert relative(like()) < guard.UNLIKE / 5
    assert relative(UNLIKE["scaled by 10"]()) > guard.UNLIKE


async def test_a_zero_chunk_through_a_store_comes_back_as_zeros(
    plain: Loaded, tmp_path: Path
) -> None:
    """Before the guard, a zero chunk came back as values of norm ~105 (the calibration's
    mean and whatever its basis made of the zeros)."""
    cal = tmp_path / "model.kvtc"
    cal.write_bytes(plain.data)
    tier = {"url": f"file://{tmp_path / 'tier'}", "codec": "kvtc"}
    config = {"tiers": [{**tier, "codec_options": {"calibration": str(cal)}}]}
    zeros = torch.zeros(2, LAYERS, 64, CHANNELS, dtype=torch.float16)
    async with Store(config) as store:
        await store.put("zeros", zeros, fmt=F.KV_2LTD, position=POSITION, durable=True)
    async with Store(config) as store:
        got = await store.get("zeros")
    assert isinstance(got, torch.Tensor)
    assert torch.equal(got, zeros)
