"""``kvtc`` weights: what they are made of (queries, output projections, layer sensitivity)
and what they do to a calibration (errors move to where they cost less)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvtc_data import CHANNELS, LAYERS, ROPE, calibration_chunks, correlated_kv

from gateway.bench.kv_sensitivity import SINKS, layer_sensitivity
from gateway.codec import encode_frame
from gateway.frame import decode_frame
from gateway.objects import to_object_data
from gateway.types import MemoryFormat
from serde.kvtc import registry
from serde.kvtc import rope as rope_ops
from serde.kvtc.calibration import CalibrationError, from_bytes, to_bytes
from serde.kvtc.codec import KvtcCodec
from serde.kvtc.fit import fit
from serde.kvtc.weights import (
    key_channel_weights,
    value_channel_weights,
    with_layer_sensitivity,
)

HEAD_DIM = ROPE.head_dim
KV_HEADS = CHANNELS // HEAD_DIM


def test_key_weights_are_the_queries_energy_per_rope_pair_and_per_kv_head() -> None:
    g = torch.Generator().manual_seed(0)
    heads = 2 * KV_HEADS  # two query heads read each KV head
    q = torch.randn(LAYERS, 300, heads * HEAD_DIM, generator=g)
    q[..., 3] *= 10.0  # channel 3 of query head 0 (KV head 0) and its RoPE pair are loud
    w = key_channel_weights(q.numpy(), KV_HEADS, HEAD_DIM)
    assert w.shape == (LAYERS, CHANNELS)
    assert np.allclose(w.mean(axis=1), 1.0)
    half = HEAD_DIM // 2
    assert w[0, 3] == pytest.approx(w[0, 3 + half])  # a RoPE pair shares its weight
    assert w[0, 3] > 10 * np.median(w[0])
    assert w[0, HEAD_DIM + 3] < 2 * np.median(w[0])  # the other KV head's channel 3 is not
    # RoPE turns pairs: rotated queries give the same weights.
    rotated = rope_ops.apply(q, ROPE, torch.arange(1000, 1300))
    assert np.allclose(key_channel_weights(rotated.numpy(), KV_HEADS, HEAD_DIM), w, rtol=1e-4)


def test_value_weights_follow_the_output_projection_columns() -> None:
    heads = 2 * KV_HEADS
    o_proj = np.ones((LAYERS, 16, heads * HEAD_DIM))
    o_proj[1, :, HEAD_DIM + 5] = 3.0  # query head 1 reads KV head 0: its channel 5 costs 9x
    w = value_channel_weights(o_proj, KV_HEADS, HEAD_DIM)
    assert np.allclose(w[0], 1.0)
    assert w[1, 5] / w[1, 6] == pytest.approx((9 + 1) / 2)
    with pytest.raises(ValueError, match="evenly"):
        value_channel_weights(np.ones((LAYERS, 16, 3 * HEAD_DIM)), KV_HEADS, HEAD_DIM)


class QuadraticCost:
    """A stand-in for a model's end-to-end KL with known per-(plane, layer) sensitivities:
    KL = sum of sensitivity * mean weighted squared error."""

    def __init__(self, kv: torch.Tensor, channel: tuple[np.ndarray, np.ndarray]) -> None:
        self.kv = kv.float()
        self.weights = [torch.from_numpy(c).float() for c in channel]
        self.sensitivity = np.array([[1.0, 4.0, 0.25, 2.0], [8.0, 0.5, 1.0, 1.0]])

    def measure(self, kv_hat: torch.Tensor) -> tuple[float, float]:
        err = (kv_hat.float() - self.kv) ** 2
        kl = 0.0
        for p in range(2):
            for layer in range(LAYERS):
                mse = float((err[p, layer] * self.weights[p][layer]).mean())
                kl += self.sensitivity[p, layer] * mse
        return kl, 1.0


def test_layer_sensitivity_recovers_known_sensitivities() -> None:
    kv = correlated_kv(512, 0, seed=7, dtype=torch.float32)
    g = np.random.default_rng(0)
    channel = (g.uniform(0.2, 3.0, (LAYERS, CHANNELS)), g.uniform(0.2, 3.0, (LAYERS, CHANNELS)))
    cost = QuadraticCost(kv, channel)
    got = layer_sensitivity(cost, kv, channel, chunk_starts=[0])  # type: ignore[arg-type]
    coded_share = (512 - SINKS) / 512  # the sinks get no noise
    assert np.allclose(got, cost.sensitivity * coded_share, rtol=0.1)


def _errors(loaded: object, kv: torch.Tensor, position: int) -> torch.Tensor:
    """Squared error per (plane, layer, channel) of a round trip through the codec."""
    registry.register(loaded.data)  # type: ignore[attr-defined]
    codec = KvtcCodec(loaded.sha256)  # type: ignore[attr-defined]
    data = to_object_data(kv, fmt=MemoryFormat.KV_2LTD)
    data.position = position
    head, parts, _ = encode_frame(codec, data)
    header, body = decode_frame(head + b"".join(bytes(p) for p in parts))
    raw = codec.decode(body, header, memoryview(bytearray(header.raw_len)))
    got = torch.frombuffer(bytearray(raw), dtype=kv.dtype).reshape(kv.shape)
    return ((got.float() - kv.float()) ** 2).mean(dim=2)


def test_weighted_channels_get_smaller_errors_and_a_free_layer_none_at_all() -> None:
    chunks = calibration_chunks()
    kv = correlated_kv(128, 4096, seed=42)
    keys = np.ones((LAYERS, CHANNELS))
    keys[:, : CHANNELS // 2] = 50.0  # the first half of every layer's key channels is dear
    values = with_layer_sensitivity(np.ones((LAYERS, CHANNELS)), np.array([1, 1, 1, 1e-9]))
    plain = fit(chunks, rel_error=0.05, rope=ROPE)
    weighted = fit(
        chunks, rel_error=0.05, rope=ROPE, weights=[keys, values, keys], shared_step=True
    )
    cal = weighted.cal
    assert len({p.step for p in cal.planes}) == 1  # one step for keys and values
    assert cal.planes[1].groups[LAYERS - 1].rank == 0  # the nearly free layer is dropped
    e_plain, e_weighted = _errors(plain, kv, 4096), _errors(weighted, kv, 4096)
    dear, cheap = slice(0, CHANNELS // 2), slice(CHANNELS // 2, CHANNELS)
    ratio_plain = float(e_plain[0, :, dear].mean() / e_plain[0, :, cheap].mean())
    ratio_weighted = float(e_weighted[0, :, dear].mean() / e_weighted[0, :, cheap].mean())
    assert ratio_weighted < ratio_plain / 1.5
    # The dropped layer decodes to its calibration mean: finite, and its error is its spread.
    assert torch.isfinite(e_weighted).all()
    assert float(e_weighted[1, LAYERS - 1].mean()) > float(e_plain[1, LAYERS - 1].mean())


def test_a_bad_feature_scale_is_refused() -> None:
    keys = np.full((LAYERS, CHANNELS), 2.0)
    loaded = fit(calibration_chunks(2), rope=ROPE, weights=[keys, None, keys])
    group = loaded.cal.planes[0].groups[0]
    assert len(group.scale) == 4 * CHANNELS
    for bad in (b"\0" * len(group.scale), group.scale[:-4], b"\xff" * len(group.scale)):
        planes = list(loaded.cal.planes)
        groups = [group.__class__(**{**_fields(group), "scale": bad}), *planes[0].groups[1:]]
        planes[0] = planes[0].__class__(step=planes[0].step, groups=groups)
        mangled = loaded.cal.__class__(**{**_fields(loaded.cal), "planes": planes})
        with pytest.raises(CalibrationError):
            from_bytes(to_bytes(mangled))
    with pytest.raises(ValueError, match="weights must be positive"):
        fit(calibration_chunks(2), rope=ROPE, weights=[-keys])


def _fields(struct: object) -> dict[str, object]:
    return {f: getattr(struct, f) for f in struct.__struct_fields__}  # type: ignore[attr-defined]
