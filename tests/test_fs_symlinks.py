"""file:// never follows a symlink inside its directory.

Each test points links at a directory outside the root ("outside") that holds what a link could
make kvgate act on: valid kvgate records, foreign files, temp-looking files. Whatever the
connector does, nothing there may be served, moved, deleted or written. The root itself may be
a symlink (the user chose the path).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

from connectors.fs import record as rec
from connectors.fs.connector import FileConnector
from gateway.errors import ConfigError
from gateway.testing import assert_same_bytes, listed

Snapshot = dict[str, tuple[str, bytes | str, int]]


def snapshot(top: Path) -> Snapshot:
    """Every path under ``top``: its kind, its bytes (or link target) and its mtime."""
    found: Snapshot = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            st = path.lstat()
            if path.is_symlink():
                found[str(path)] = ("link", os.readlink(path), st.st_mtime_ns)
            elif path.is_dir():
                found[str(path)] = ("dir", b"", st.st_mtime_ns)
            else:
                found[str(path)] = ("file", path.read_bytes(), st.st_mtime_ns)
    return found


def fan_out(key: str) -> tuple[str, str, str]:
    return rec.object_name(key)


async def stored_elsewhere(where: Path, *keys: str) -> None:
    """Real kvgate records of ``keys`` (value: the key's bytes) under ``where``'s objects/."""
    other = FileConnector(where)
    for key in keys:
        await other.put(key, key.encode())
    await other.close()


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    path = tmp_path / "outside"
    path.mkdir()
    return path


def warnings_about(caplog: pytest.LogCaptureFixture, kind: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and kind in r.getMessage() and "symlink" in r.getMessage()
    ]


@pytest.mark.parametrize("level", ["top", "sub"])
async def test_symlinked_fan_out_dir_is_not_served_emptied_or_written(
    tmp_path: Path, outside: Path, level: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Two fan-out dirs that link outside, at either level: their valid records are not served,
    their foreign files are not quarantined, a put there fails, and nothing outside changes."""
    keys = ("k1", "k2")
    await stored_elsewhere(outside / "store", *keys)
    root = tmp_path / "root"
    await FileConnector(root).close()
    for key in keys:
        a, b, _ = fan_out(key)
        there = outside / "store" / "objects" / a / b
        (there / "foreign.txt").write_bytes(b"not kvgate's")  # scanned, it would be quarantined
        (there / f"{'0' * 40}.kvo").write_bytes(b"KVGD broken")
        link = root / "objects" / a if level == "top" else root / "objects" / a / b
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(there.parent if level == "top" else there, target_is_directory=True)
    before = snapshot(outside)

    conn = FileConnector(root)
    with caplog.at_level(logging.WARNING, logger="connectors.fs.connector"):
        for key in keys:
            assert await conn.get(key) is None
            assert not await conn.exists(key)
        assert await listed(conn, "") == {}
        assert conn.corrupt_files == 0
        for key in keys:
            with pytest.raises(ConfigError, match="symlink"):
                await conn.put(key, b"through the link")
            assert not await conn.exists(key)
            assert not await conn.delete(key)
        await conn.put("elsewhere", b"fine")  # the rest of the tier still works
        assert await conn.get("elsewhere") == b"fine"
    await conn.close()
    assert snapshot(outside) == before
    assert list((root / "quarantine").iterdir()) == []
    assert len(warnings_about(caplog, "fan-out directory")) == 1, caplog.text


@pytest.mark.parametrize("name", ["tmp", "quarantine", "objects", ".lock"])
async def test_symlinked_fixed_path_refuses_the_directory(
    tmp_path: Path, outside: Path, name: str
) -> None:
    """tmp/, quarantine/, objects/ or .lock as a link: a clear error before anything is
    touched (today's code emptied a linked tmp/ at start and wrote its pid through .lock)."""
    (outside / "half-a-put.kvo.0123456789abcdef").write_bytes(b"someone's file")
    (outside / "notes").write_bytes(b"keep me")
    await stored_elsewhere(outside / "store", "k")
    root = tmp_path / "root"
    await FileConnector(root).close()
    target = outside / "notes" if name == ".lock" else outside
    shutil.rmtree(root / name) if name != ".lock" else (root / name).unlink()
    (root / name).symlink_to(target)
    before = snapshot(outside)

    async def use_it() -> None:
        conn = FileConnector(root)
        try:
            await conn.open()  # today's code empties a linked tmp/ here
            await conn.put("k2", b"x")
        finally:
            await conn.close()

    with pytest.raises(ConfigError, match="symlink") as err:
        await use_it()
    assert str(root / name) in str(err.value)
    assert snapshot(outside) == before


async def test_symlinked_object_file_is_not_served_replaced_or_removed(
    tmp_path: Path, outside: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An object file that becomes a link to a valid record of the same key (so following it
    would serve it): a miss, and neither delete, eviction nor a put removes or replaces it."""
    root = tmp_path / "root"
    conn = FileConnector(root, capacity=100)
    links = {}
    with caplog.at_level(logging.WARNING, logger="connectors.fs.connector"):
        for key in ("a", "b", "c"):
            await conn.put(key, key.encode() * 10)
            path = Path(conn.path_for(key))
            moved = outside / f"{key}.kvo"
            shutil.copy(path, moved)
            os.unlink(path)
            os.symlink(moved, path)
            links[key] = path
        before = snapshot(outside)
        assert await conn.get("a") is None  # today: served through the link
        await conn.delete("b")  # the key goes; the link stays
        assert not await conn.exists("b")
        with pytest.raises(ConfigError, match="symlink"):
            await conn.put("c", b"new")
        await conn.put("d", b"d" * 60)
        await conn.put("e", b"e" * 60)  # evicts what is left of a, b, c
        assert_same_bytes(await conn.get("e"), b"e" * 60, "e")
    await conn.close()
    assert snapshot(outside) == before
    assert all(path.is_symlink() for path in links.values())
    assert list((root / "quarantine").iterdir()) == []
    assert len(warnings_about(caplog, "object file")) == 1, caplog.text

    # At start, the links are skipped too (once more, a new connector logs once).
    again = FileConnector(root)
    assert await listed(again, "") == {"e": 60}
    await again.close()
    assert snapshot(outside) == before
    assert all(path.is_symlink() for path in links.values())


async def test_symlinks_in_tmp_are_left_alone(tmp_path: Path, outside: Path) -> None:
    """Stale temp files are removed at start; a link among them is not (nor its target)."""
    root = tmp_path / "root"
    await FileConnector(root).close()
    (outside / "precious").write_bytes(b"keep")
    (root / "tmp" / "link.kvo.0123456789abcdef").symlink_to(outside / "precious")
    (root / "tmp" / "stale.kvo.0123456789abcdef").write_bytes(b"half a put")
    (root / "tmp" / "subdir").mkdir()  # not a put's either; used to stop the scan
    conn = FileConnector(root)
    await conn.open()
    await conn.close()
    assert sorted(p.name for p in (root / "tmp").iterdir()) == [
        "link.kvo.0123456789abcdef",
        "subdir",
    ]
    assert (outside / "precious").read_bytes() == b"keep"


async def test_root_given_as_a_symlink_works(tmp_path: Path) -> None:
    """Only links inside the root are refused: the root's own path is the user's choice."""
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    conn = FileConnector(link)
    await conn.put("k", b"value")
    await conn.close()
    again = FileConnector.from_url(link.as_uri())
    assert await again.get("k") == b"value"
    await again.close()
    assert len(list((real / "objects").rglob("*.kvo"))) == 1
