"""Which keys a tier may hold older versions of is known only to the process that wrote them:
a clean close deletes them there (``TierWriter.scrub``), so that a store opened later on the
same tiers never serves a version that a failed write or delete left behind."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from connectors.memory import MemoryConnector
from gateway import Store
from gateway.errors import IncompleteDelete
from gateway.layers import ChaosLayer


def _config(disk: Path, shared: str) -> dict[str, Any]:
    """Memory, a small disk tier, then a remote that keeps what it was given."""
    return {
        "tiers": [
            {"url": "memory://", "capacity": 8 << 20},
            {"url": f"file://{disk}", "capacity": 1 << 20, "timeout": 1.0},
            {"url": shared, "timeout": 1.0},
        ],
        "staging": 4 << 20,
    }


async def test_a_failed_write_leaves_no_older_version_for_the_next_store(tmp_path: Path) -> None:
    shared = f"memory://{uuid.uuid4().hex}"
    remote = MemoryConnector.from_url(shared)
    async with Store(_config(tmp_path, shared), connectors={2: remote}) as store:
        await store.put("k", b"1" * 1000)
        await store.flush()
        await store.put("k", b"2" * (2 << 20))  # over the disk tier's capacity: that write fails
        await store.flush()
    # The disk tier kept "1" * 1000 through the failed write; the next store must not serve it.
    remote = MemoryConnector.from_url(shared)
    async with Store(_config(tmp_path, shared), connectors={2: remote}) as store:
        assert await store.get("k") == b"2" * (2 << 20)
        assert await store.lookup(["k"]) == 1


async def test_a_failed_delete_raises_and_is_done_again_at_close(tmp_path: Path) -> None:
    shared = f"memory://{uuid.uuid4().hex}"
    remote = ChaosLayer(MemoryConnector.from_url(shared))
    async with Store(_config(tmp_path, shared), connectors={2: remote}) as store:
        await store.put("k", b"v" * 1000)
        await store.flush()
        remote.down = True
        with pytest.raises(IncompleteDelete, match="may still be in tier"):
            await store.delete("k")
        assert await store.get("k") is None  # the remote may still hold it: not read
        remote.down = False
    again = MemoryConnector.from_url(shared)
    assert not await again.exists("k")
    async with Store(_config(tmp_path, shared), connectors={2: again}) as store:
        assert await store.get("k") is None


async def _deletes_failed(remote: ChaosLayer, tmp_path: Path, shared: str, keys: str) -> Store:
    """An open store whose deletes of ``keys`` failed on ``remote`` (left down)."""
    store = Store(_config(tmp_path, shared), connectors={2: remote})
    await store.open()
    for key in keys:
        await store.put(key, b"v" * 1000)
    await store.flush()
    remote.down = True
    for key in keys:
        with pytest.raises(IncompleteDelete, match="may still be in tier"):
            await store.delete(key)
    return store


async def test_a_tier_still_down_at_close_is_logged_not_waited_for(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shared = f"memory://{uuid.uuid4().hex}"
    store = await _deletes_failed(
        ChaosLayer(MemoryConnector.from_url(shared)), tmp_path, shared, "k"
    )
    with caplog.at_level(logging.WARNING, logger="kvgate.jobs"):
        await store.close()
    assert any("1 key it may hold older versions of" in r.message for r in caplog.records)


class _ShortExists(ChaosLayer):
    """Answers existence checks for the first key only (a short answer is legal)."""

    async def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return (await super().exists_many(keys))[:1]


async def test_a_short_existence_answer_is_logged_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shared = f"memory://{uuid.uuid4().hex}"
    remote = _ShortExists(MemoryConnector.from_url(shared))
    store = await _deletes_failed(remote, tmp_path, shared, "ab")
    remote.down = False
    with caplog.at_level(logging.WARNING, logger="kvgate.jobs"):
        await store.close()
    assert any("1 key it may hold older versions of" in r.message for r in caplog.records)
