"""The entry-point registry: built-ins, a third-party plugin, and install hints."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from plugin_dist import installed

from gateway import registry
from gateway.errors import MissingDependency, NotFound


@pytest.fixture
def plugin_dist(tmp_path: Path) -> Iterator[Path]:
    """A real installed distribution (dist-info on sys.path) that registers two schemes."""
    toy = textwrap.dedent("""
        from connectors.memory import MemoryConnector

        class ToyConnector(MemoryConnector):
            scheme = "toy"

            @classmethod
            def from_url(cls, url, **options):
                return cls()
    """)
    # The "broken" plugin's own module is there; the SDK it needs (its extra) is not.
    modules = {"toyplug": toy, "toyplug_broken": "import missing_sdk_xyz\n"}
    entries = (
        "[kvgate.connectors]\ntoy = toyplug:ToyConnector\nbroken = toyplug_broken:Thing\n"
        "gone = toyplug_gone:Thing\n"
    )
    with installed(tmp_path, "toyplug", modules, entries, "Provides-Extra: broken\n") as where:
        yield where


def test_builtins_are_registered() -> None:
    names = {s.name for s in registry.connector_status()}
    assert {"memory", "file", "blackhole"} <= names
    assert {s.name for s in registry.codec_status() if s.usable} >= {"raw", "zstd"}


async def test_third_party_scheme_without_core_change(plugin_dist: Path) -> None:
    conn = registry.connect("toy://anything")
    assert type(conn).__name__ == "ToyConnector"
    await conn.put("k", b"v")
    assert await conn.get("k") == b"v"
    status = {s.name: s for s in registry.connector_status()}
    assert status["toy"].usable
    assert status["toy"].distribution == "toyplug"


def test_missing_dependency_gives_install_hint(plugin_dist: Path) -> None:
    with pytest.raises(MissingDependency, match=r"pip install 'toyplug\[broken\]'"):
        registry.connect("broken://host")
    status = {s.name: s for s in registry.connector_status()}
    assert not status["broken"].usable
    assert "missing_sdk_xyz" in status["broken"].problem


def test_missing_plugin_module_is_a_broken_install_not_an_extra(plugin_dist: Path) -> None:
    # The entry point names a module that is not installed at all: no extra would help.
    with pytest.raises(ModuleNotFoundError, match="toyplug_gone"):
        registry.connect("gone://host")
    status = {s.name: s for s in registry.connector_status()}
    assert not status["gone"].usable
    assert "pip install" not in status["gone"].problem


def test_unknown_scheme_and_codec() -> None:
    with pytest.raises(NotFound, match="known:"):
        registry.connect("nosuch://x")
    with pytest.raises(NotFound):
        registry.load_codec("nosuch")
    with pytest.raises(NotFound):
        registry.connect("no-scheme-here")
