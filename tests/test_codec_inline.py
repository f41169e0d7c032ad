"""Which codec work may run on the event loop: one rule (``codec_inline``), asked of the codec
instance, so a slow setting of a cheap codec (zstd at level 22) goes to a thread like a slow
codec does, and a tier's writes and reads follow it."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from gateway import Store
from gateway.registry import load_codec
from gateway.tiers import codec_inline
from serde.zstd import ZstdCodec


@pytest.mark.parametrize(
    ("name", "options", "inline"),
    [
        ("raw", {}, True),
        ("zstd", {}, True),
        ("zstd", {"level": -7}, True),
        ("zstd", {"level": 3, "threads": 1}, True),
        ("zstd", {"level": 4}, False),
        ("zstd", {"level": 19}, False),
        ("zstd", {"level": 22}, False),
        ("lz4", {}, True),
        ("lz4", {"acceleration": 65537, "block_size": 4096}, True),
        ("bytesplit", {}, True),
        ("bytesplit", {"level": 3, "hash_log": None, "block_size": 64 << 10}, True),
        ("bytesplit", {"level": 9}, False),
        ("bytesplit", {"block_size": 4096}, False),
        ("zstd+lz4", {}, False),  # a chain does not say: a thread
    ],
)
def test_the_codec_instance_decides(name: str, options: dict[str, Any], inline: bool) -> None:
    assert codec_inline(load_codec(name, **options)) is inline


def test_a_codec_that_does_not_say_runs_in_a_thread() -> None:
    class Plugin:
        name = "plugin"
        lossless = True

    class Says:
        name = "says"
        lossless = True
        inline_ok = "yes"  # not True: a thread

    assert not codec_inline(Plugin())  # type: ignore[arg-type]  # encode/decode not needed
    assert not codec_inline(Says())  # type: ignore[arg-type]


@pytest.fixture
def zstd_threads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """(what, thread) for every zstd encode and decode, whichever instance."""
    seen: list[tuple[str, int]] = []

    def recording(what: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: ZstdCodec, *args: Any) -> Any:
            seen.append((what, threading.get_ident()))
            return fn(self, *args)

        return run

    monkeypatch.setattr(ZstdCodec, "encode", recording("encode", ZstdCodec.encode))
    monkeypatch.setattr(ZstdCodec, "decode", recording("decode", ZstdCodec.decode))
    return seen


@pytest.mark.parametrize(("level", "on_loop"), [(3, True), (19, False)])
async def test_a_tiers_codec_setting_decides_where_its_work_runs(
    zstd_threads: list[tuple[str, int]], level: int, on_loop: bool
) -> None:
    loop = threading.get_ident()
    tier = {
        "url": f"memory://{uuid.uuid4().hex}",
        "codec": "zstd",
        "codec_options": {"level": level},
    }
    obj = np.random.default_rng(0).standard_normal(64 << 10).astype(np.float16)  # 128 KiB
    async with Store({"tiers": [tier]}) as store:
        await store.put("k", obj, durable=True)  # written, so the get reads it back
        np.testing.assert_array_equal(await store.get("k"), obj)
    assert [what for what, _ in zstd_threads] == ["encode", "decode"]
    assert [thread == loop for _, thread in zstd_threads] == [on_loop, on_loop]
