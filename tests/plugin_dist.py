"""A plugin installed for one test: a distribution's dist-info and its modules on sys.path,
found by kvgate's registry through its entry points, and gone again afterwards."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

from gateway import registry


@contextlib.contextmanager
def installed(
    where: Path, name: str, modules: dict[str, str], entry_points: str, metadata: str = ""
) -> Iterator[Path]:
    """Install distribution ``name`` (``modules``: module name to source; ``entry_points``:
    the text of its entry_points.txt; ``metadata``: more METADATA lines) under ``where``."""
    for module, source in modules.items():
        (where / f"{module}.py").write_text(source)
    info = where / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n{metadata}")
    (info / "entry_points.txt").write_text(entry_points)
    sys.path.insert(0, str(where))
    registry._entry_points.cache_clear()
    try:
        yield where
    finally:
        sys.path.remove(str(where))
        for module in modules:
            sys.modules.pop(module, None)
        registry._entry_points.cache_clear()
