"""``kvtc``: calibration objects, RoPE, the codec with a calibration, and calibrations fetched
from the store by a reader that does not have them."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
import torch
from kvtc_data import CHANNELS, LAYERS, ROPE, calibration_chunks, correlated_kv

from gateway.codec import encode_frame
from gateway.errors import CorruptObject
from gateway.frame import FrameInfo, decode_frame
from gateway.objects import ObjectData, to_object_data
from gateway.side_objects import MissingSideObject
from gateway.types import MemoryFormat
from serde.cachegen import CacheGenCodec
from serde.kvtc import registry, symbols
from serde.kvtc import rope as rope_ops
from serde.kvtc.calibration import CalibrationError, from_bytes, to_bytes
from serde.kvtc.codec import KvtcCodec, _coefficients_host
from serde.kvtc.fit import fit

F = MemoryFormat


@pytest.fixture(scope="module")
def calibrated() -> str:
    loaded = fit(calibration_chunks(), group=2, rel_error=0.03, rope=ROPE, note="test")
    registry.register(loaded.data)
    return loaded.sha256


def round_trip(
    codec: KvtcCodec, src: torch.Tensor, position: int | None = None
) -> tuple[torch.Tensor, int, FrameInfo]:
    data = to_object_data(src, fmt=F.KV_2LTD)
    data.position = position
    head, parts, _ = encode_frame(codec, data)
    blob = head + b"".join(bytes(p) for p in parts)
    header, body = decode_frame(blob)
    raw = codec.decode(body, header, memoryview(bytearray(header.raw_len)))
    got = torch.frombuffer(bytearray(raw), dtype=src.dtype).reshape(src.shape)
    return got, len(blob), header


def plane_errors(src: torch.Tensor, got: torch.Tensor) -> list[float]:
    return [float((got[p].float() - src[p].float()).norm() / src[p].float().norm()) for p in (0, 1)]


# -- RoPE ----------------------------------------------------------------------------------


def test_rope_undo_inverts_apply() -> None:
    k = torch.randn(3, 50, CHANNELS)
    pos = torch.arange(1000, 1050)
    rotated = rope_ops.apply(k, ROPE, pos)
    assert not torch.allclose(rotated, k, atol=1e-2)  # it does rotate
    torch.testing.assert_close(rope_ops.undo(rotated, ROPE, pos), k, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(rope_ops.apply(rope_ops.undo(k, ROPE, pos), ROPE, pos), k)
    # A rotation: norms per head are kept.
    heads = rotated.reshape(3, 50, -1, ROPE.head_dim).norm(dim=-1)
    torch.testing.assert_close(heads, k.reshape(3, 50, -1, ROPE.head_dim).norm(dim=-1))


def test_rope_at_position_zero_is_the_identity() -> None:
    k = torch.randn(2, 1, CHANNELS)
    torch.testing.assert_close(rope_ops.apply(k, ROPE, torch.zeros(1, dtype=torch.int64)), k)


# -- the calibration object ----------------------------------------------------------------


def test_calibration_bytes_round_trip_and_hash_is_stable(calibrated: str) -> None:
    loaded = registry.lookup(calibrated)
    assert loaded is not None
    assert to_bytes(from_bytes(loaded.data)) == loaded.data
    again = fit(calibration_chunks(), group=2, rel_error=0.03, rope=ROPE, note="test")
    assert again.sha256 == calibrated  # same data and options: same content, same name
    other = fit(calibration_chunks(), group=2, rel_error=0.05, rope=ROPE, note="test")
    assert other.sha256 != calibrated
    cal = loaded.cal
    assert (cal.layers, cal.channels, cal.group) == (LAYERS, CHANNELS, 2)
    assert len(cal.planes) == 3  # unrotated keys, values, post-RoPE keys
    ranks = [[g.rank for g in p.groups] for p in cal.planes]
    # Low-rank data: few components carry the energy; post-RoPE keys need more of them.
    assert max(ranks[0] + ranks[1]) < 2 * CHANNELS / 4, ranks
    assert min(ranks[2]) > max(ranks[0]), ranks
    full = 3 * (LAYERS // 2) * (2 * CHANNELS) ** 2 * 2
    assert cal.basis_bytes() < full / 2


@pytest.mark.parametrize(
    "mangle",
    [
        lambda b: b[:-1],
        lambda b: b + b"\x00",
        lambda b: b"\x00" * len(b),
        lambda b: msgspec.msgpack.encode({"version": 1}),
    ],
)
def test_malformed_calibration_bytes_are_refused(calibrated: str, mangle: object) -> None:
    loaded = registry.lookup(calibrated)
    assert loaded is not None
    with pytest.raises(CalibrationError):
        from_bytes(mangle(loaded.data))  # type: ignore[operator]


def test_inconsistent_calibration_is_refused(calibrated: str) -> None:
    loaded = registry.lookup(calibrated)
    assert loaded is not None
    cal = loaded.cal
    bad_group = msgspec.structs.replace(
        cal.planes[0].groups[0], rank=cal.planes[0].groups[0].rank + 1
    )
    plane = msgspec.structs.replace(cal.planes[0], groups=[bad_group, *cal.planes[0].groups[1:]])
    with pytest.raises(CalibrationError, match="sizes"):
        from_bytes(to_bytes(msgspec.structs.replace(cal, planes=[plane, *cal.planes[1:]])))
    with pytest.raises(CalibrationError, match="table"):
        from_bytes(to_bytes(msgspec.structs.replace(cal, tables=cal.tables[:-1])))


def test_registry_refuses_bytes_that_are_not_the_named_calibration(calibrated: str) -> None:
    loaded = registry.lookup(calibrated)
    assert loaded is not None
    with pytest.raises(CorruptObject, match="altered"):
        registry.register(loaded.data + b" ", expected=calibrated)


# -- the codec with a calibration ----------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("position", [None, 0, 256, 10_000])
def test_round_trip_error_is_near_the_calibrated_target(
    calibrated: str, dtype: torch.dtype, position: int | None
) -> None:
    codec = KvtcCodec(calibration=calibrated)
    src = correlated_kv(96, position or 0, seed=7, dtype=dtype)
    got, size, header = round_trip(codec, src, position)
    assert header.params["cal"] == calibrated
    assert ("pos" in header.params) == (position is not None)
    assert ("theta" in header.params) == (position is not None)
    errors = plane_errors(src, got)
    # Unrotated keys match the calibration; post-RoPE keys (no position) cost ratio, not error.
    assert max(errors) < 0.06, errors
    head = int(header.params["head"])
    assert head == (4 if position in (None, 0) else 0)
    assert torch.equal(got[:, :, :head], src[:, :, :head])  # sinks are exact
    assert size < src.numel() * src.element_size() / 4


def test_recent_window_is_exact(calibrated: str) -> None:
    codec = KvtcCodec(calibration=calibrated, window=16, sinks=0)
    src = correlated_kv(64, 512, seed=8)
    got, _, header = round_trip(codec, src, 512)
    assert (header.params["tail"], header.params["head"]) == (16, 0)
    assert torch.equal(got[:, :, -16:], src[:, :, -16:])
    assert not torch.equal(got[:, :, :-16], src[:, :, :-16])


def test_undoing_rope_pays_off(calibrated: str) -> None:
    """Same chunk, same calibration: the frame that knows its position is smaller."""
    codec = KvtcCodec(calibration=calibrated)
    src = correlated_kv(128, 2048, seed=9)
    _, with_pos, _ = round_trip(codec, src, 2048)
    _, without, _ = round_trip(codec, src, None)
    assert with_pos < without


def test_beats_cachegen_at_the_same_error(calibrated: str) -> None:
    codec = KvtcCodec(calibration=calibrated, sinks=0)
    src = correlated_kv(128, 1024, seed=11)
    got, size, _ = round_trip(codec, src, 1024)
    kvtc_error = max(plane_errors(src, got))
    # cachegen at a quality that makes its error no larger than kvtc's.
    for quality in (1.0, 2.0, 4.0, 8.0, 16.0):
        cg = CacheGenCodec(quality=quality)
        data = to_object_data(src, fmt=F.KV_2LTD)
        head, parts, _ = encode_frame(cg, data)
        header, body = decode_frame(head + b"".join(bytes(p) for p in parts))
        raw = cg.decode(body, header, None)
        out = torch.frombuffer(bytearray(raw), dtype=src.dtype).reshape(src.shape)
        if max(plane_errors(src, out)) <= kvtc_error:
            cg_size = len(head) + sum(memoryview(p).nbytes for p in parts)
            break
    else:
        pytest.fail("cachegen never reached kvtc's error")
    assert size * 2 < cg_size, (size, cg_size)


def test_a_chunk_the_calibration_does_not_fit_goes_through_cachegen(calibrated: str) -> None:
    codec = KvtcCodec(calibration=calibrated)
    src = torch.randn(2, LAYERS + 1, 40, CHANNELS).half()
    got, _, header = round_trip(codec, src, 0)
    assert header.params["via"] == "cachegen"
    assert max(plane_errors(src, got)) <= codec.documented_rel_error


def test_nan_is_stored_verbatim(calibrated: str) -> None:
    src = correlated_kv(32, 64, seed=3)
    src[1, 2, 5, 7] = float("nan")
    got, _, header = round_trip(KvtcCodec(calibration=calibrated), src, 64)
    assert header.params == {"mode": "raw"}
    assert torch.equal(got.view(torch.uint8), src.view(torch.uint8))


def test_unknown_calibration_raises_missing_side_object(calibrated: str) -> None:
    codec = KvtcCodec(calibration=calibrated)
    data = to_object_data(correlated_kv(32, 0, seed=4), fmt=F.KV_2LTD)
    head, parts, _ = encode_frame(codec, data)
    header, body = decode_frame(head + b"".join(bytes(p) for p in parts))
    other = msgspec.structs.replace(header, params={**header.params, "cal": "ab" * 32})
    with pytest.raises(MissingSideObject) as caught:
        codec.decode(body, other, None)
    assert caught.value.key.endswith("ab" * 32)
    with pytest.raises(CorruptObject):  # bytes that are not that calibration
        caught.value.install(registry.lookup(calibrated).data)  # type: ignore[union-attr]


def test_hostile_payloads_and_params_never_crash(calibrated: str) -> None:
    codec = KvtcCodec(calibration=calibrated)
    data: ObjectData = to_object_data(correlated_kv(40, 300, seed=5), fmt=F.KV_2LTD)
    data.position = 300
    head, parts, _ = encode_frame(codec, data)
    header, body = decode_frame(head + b"".join(bytes(p) for p in parts))
    rng = np.random.default_rng(0)
    payloads = [body[:-1], bytes(body) + b"\x00", rng.bytes(len(body)), b"\x00" * len(body)]
    flipped = bytearray(body)
    for i in range(0, len(flipped), 97):
        flipped[i] ^= 0x5A
    payloads.append(bytes(flipped))
    for bad in payloads:
        _decodes_or_corrupt(codec, memoryview(bad), header)
    hostile = [None, -1, 0, 2**62, "x", 1.5, True, math.inf, [1]]
    for key in ("head", "tail", "block", "pos", "theta", "hd", "cal", "v", "via"):
        for value in hostile:
            params = {**header.params, key: value}
            _decodes_or_corrupt(codec, body, msgspec.structs.replace(header, params=params))


def _decodes_or_corrupt(codec: KvtcCodec, body: memoryview, header: FrameInfo) -> None:
    try:
        raw = codec.decode(body, header, memoryview(bytearray(header.raw_len)))
    except CorruptObject:
        return
    assert memoryview(raw).nbytes == header.raw_len


def test_numba_kernels_write_and_read_the_reference_payload(
    calibrated: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused CPU kernels and the spec (generic rANS coders) agree byte for byte, with
    escapes (a chunk far from the calibration) and shifted components."""
    codec = KvtcCodec(calibration=calibrated)
    src = correlated_kv(80, 300, seed=21)
    # Out-of-range coefficients (escapes), yet close enough to the calibration that kvtc codes
    # the chunk (x30 made it go to cachegen: serde.kvtc.guard).
    src[:, :, 40:50] *= 2
    data = to_object_data(src, fmt=F.KV_2LTD)
    data.position = 300
    head, parts, _ = encode_frame(codec, data)
    fast = head + b"".join(bytes(p) for p in parts)
    coded = _coefficients_host(codec.loaded, (0, 1), src.float(), ROPE, 300)
    assert coded is not None
    coords = codec.loaded.coords((0, 1))
    high = coded[0].astype(np.int64) >> coords.shift[:, None]
    assert (symbols.symbol_index(high, coords.rng[:, None]) == 0).any()  # escapes there are
    header, body = decode_frame(fast)
    assert "via" not in header.params
    assert header.params["cal"] == calibrated
    fast_out = bytes(codec.decode(body, header, None))
    monkeypatch.setenv("KVGATE_KERNELS", "reference")
    head, parts, _ = encode_frame(codec, data)
    ref = head + b"".join(bytes(p) for p in parts)
    _, ref_body = decode_frame(ref)
    assert bytes(ref_body) == bytes(body)
    assert bytes(codec.decode(body, header, None)) == fast_out
    got = torch.frombuffer(bytearray(fast_out), dtype=src.dtype).reshape(src.shape)
    # (The scaled tokens leave the calibrated subspace: truncation error, not a coder's.)
    assert max(plane_errors(src[:, :, :40], got[:, :, :40])) < 0.06


def test_the_device_transform_matches_the_host_one(calibrated: str) -> None:
    """The torch path (what a CUDA tensor takes) and the numpy host path give the same
    coefficients, up to float32 rounding at a tie (run here on the CPU)."""
    from serde.kvtc.codec import _coefficients_host, _coefficients_torch

    loaded = registry.lookup(calibrated)
    assert loaded is not None
    kv = correlated_kv(64, 1000, seed=31)
    for planes, rope in (((0, 1), ROPE), ((2, 1), None)):
        host_coded = _coefficients_host(loaded, planes, kv, rope, 1000)
        torch_coded = _coefficients_torch(loaded, planes, kv, rope, 1000)
        assert host_coded is not None
        assert torch_coded is not None
        (a, host_fits), (b, torch_fits) = host_coded, torch_coded
        diff = np.abs(a.astype(np.int64) - b)
        assert diff.max() <= 1
        assert (diff > 0).mean() < 1e-3
        # Both measure the same coding error (serde.kvtc.guard), group by group.
        for host_plane, torch_plane in zip(host_fits, torch_fits, strict=True):
            for (host_err, host_energy), (torch_err, torch_energy) in zip(
                host_plane, torch_plane, strict=True
            ):
                assert host_energy == pytest.approx(torch_energy, rel=1e-4)
                assert host_err == pytest.approx(torch_err, rel=1e-2)
