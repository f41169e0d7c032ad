"""The ``kvtc`` calibration registry is bounded: hashes come from frames and clients, so the
calibrations it keeps are the most recently used few; one a codec holds stays loaded while
the codec lives, and one that was dropped is loaded again from the tier when a frame names it.
"""

from __future__ import annotations

import gc
import json
import weakref
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch
from kvtc_data import ROPE, calibration_chunks, correlated_kv

from gateway import Store
from gateway.side_objects import MissingSideObject
from gateway.types import MemoryFormat
from serde.kvtc import registry
from serde.kvtc.calibration import Loaded, digest, from_bytes, to_bytes
from serde.kvtc.codec import KvtcCodec
from serde.kvtc.fit import fit

F = MemoryFormat


@pytest.fixture(scope="module")
def base() -> bytes:
    return fit(calibration_chunks(4), group=2, rel_error=0.03, rope=ROPE).data


@pytest.fixture(autouse=True)
def fresh_registry() -> Iterator[None]:
    registry.forget_all()
    yield
    registry.forget_all()


def variant(base: bytes, i: int) -> bytes:
    """A distinct calibration (another hash) with the same bases."""
    return to_bytes(msgspec.structs.replace(from_bytes(base), note=f"variant {i}"))


def alive(refs: list[weakref.ref[Loaded]]) -> int:
    gc.collect()
    return sum(r() is not None for r in refs)


def test_the_registry_keeps_the_most_recently_used_few(base: bytes) -> None:
    refs = []
    count = 3 * registry.MAX_KEPT
    for i in range(count):
        refs.append(weakref.ref(registry.register(variant(base, i))))
        assert len(registry.kept()) <= registry.MAX_KEPT
    # The older ones are gone from the registry and from memory, the newest are kept.
    assert alive(refs) == registry.MAX_KEPT
    assert all(r() is not None for r in refs[-registry.MAX_KEPT :])
    assert registry.lookup(digest(variant(base, 0))) is None
    # A lookup makes one the most recently used: the next registration drops another one.
    oldest = refs[-registry.MAX_KEPT]()
    assert oldest is not None
    assert registry.lookup(oldest.sha256) is oldest
    registry.register(variant(base, count))
    assert oldest.sha256 in registry.kept()
    del oldest


def test_the_registry_keeps_a_byte_budget(base: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    one = registry.footprint(registry.register(variant(base, 0)))
    registry.forget_all()
    monkeypatch.setattr(registry, "MAX_KEPT_BYTES", 2 * one)
    refs = [weakref.ref(registry.register(variant(base, i))) for i in range(5)]
    assert len(registry.kept()) == 2
    assert alive(refs) == 2
    monkeypatch.setattr(registry, "MAX_KEPT_BYTES", one // 2)  # the newest is kept anyway
    registry.register(variant(base, 5))
    assert len(registry.kept()) == 1


def test_a_codecs_calibration_stays_loaded_while_the_codec_lives(
    base: bytes, tmp_path: Path
) -> None:
    path = tmp_path / "model.kvtc"
    path.write_bytes(base)
    codec = KvtcCodec(calibration=str(path))
    held = codec.loaded
    assert held is not None
    sha = held.sha256
    for i in range(2 * registry.MAX_KEPT):
        registry.register(variant(base, i))
    assert sha not in registry.kept()
    # Still found by hash (the same object, not a second copy), so a codec built by hash,
    # or a frame naming it, uses it.
    assert registry.lookup(sha) is held
    assert KvtcCodec(calibration=sha).loaded is held
    assert registry.require(sha) is held
    ref = weakref.ref(held)
    del codec, held
    for i in range(2 * registry.MAX_KEPT, 3 * registry.MAX_KEPT):
        registry.register(variant(base, i))
    assert alive([ref]) == 0  # the codec is gone: so is its calibration
    assert registry.lookup(sha) is None


def test_a_calibration_installed_for_a_frame_outlives_the_retry(base: bytes) -> None:
    """The tier installs the calibration a frame names, then decodes again: calibrations other
    threads load in between cannot drop it before that decode."""
    sha = digest(base)
    with pytest.raises(MissingSideObject) as caught:
        registry.require(sha)
    caught.value.install(base)
    for i in range(2 * registry.MAX_KEPT):
        registry.register(variant(base, i))
    assert sha not in registry.kept()
    assert registry.require(sha).sha256 == sha


async def test_a_dropped_calibration_is_loaded_again_for_its_frames(
    base: bytes, tmp_path: Path
) -> None:
    path = tmp_path / "model.kvtc"
    path.write_bytes(base)
    sha = digest(base)
    tier = {"url": f"file://{tmp_path / 'disk'}", "codec": "kvtc"}
    chunks = {f"c{i}": correlated_kv(48, 48 * i, seed=30 + i) for i in range(2)}
    writer = {"tiers": [{**tier, "codec_options": {"calibration": str(path)}}]}
    async with Store(writer) as store:
        for i, (key, kv) in enumerate(chunks.items()):
            await store.put(key, kv, fmt=F.KV_2LTD, position=48 * i)
    del store  # and with it the codec that held the calibration
    ref = weakref.ref(registry.require(sha))
    async with Store({"tiers": [tier]}) as store:
        for round_ in range(2):
            for i in range(registry.MAX_KEPT):  # frames of other models: this one is dropped
                registry.register(variant(base, 10 * round_ + i))
            assert alive([ref]) == 0
            assert registry.lookup(sha) is None
            for key, kv in chunks.items():
                got = await store.get(key)
                assert isinstance(got, torch.Tensor)
                err = (got.float() - kv.float()).norm() / kv.float().norm()
                assert float(err) < 0.06
            assert store.stats()["file"].corrupt == 0
            found = registry.lookup(sha)  # loaded again from the tier's side object
            assert found is not None
            ref = weakref.ref(found)
            del found


def test_the_http_service_keeps_no_calibration_a_client_named(base: bytes) -> None:
    """Codecs built for clients' ``x-kvgate-codec-options`` are cached by the service; a kvtc
    one holds its calibration, so those are not cached: the registry's bound stays the bound."""
    from gateway.http.body import Codecs

    codecs = Codecs()
    refs = []
    for i in range(3 * registry.MAX_KEPT):
        loaded = registry.register(variant(base, i))
        refs.append(weakref.ref(loaded))
        codec = codecs.get("kvtc", json.dumps({"calibration": loaded.sha256}))
        assert codec.loaded is loaded
        del loaded, codec
    assert alive(refs) == registry.MAX_KEPT
