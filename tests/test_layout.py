"""The layout's one rule, checked on the code's own imports: the core imports no wing, and a
wing imports no other wing, except the CLI, which starts the others (README, "Layout")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

GATEWAY = Path(__file__).resolve().parents[1] / "gateway"
WINGS = ("http", "lmcache", "bench", "cli", "vllm")


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (lazy imports inside functions too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def wing_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "gateway" and parts[1] in WINGS else None


def test_the_wings_are_there() -> None:
    for wing in WINGS:
        assert (GATEWAY / wing / "__init__.py").is_file(), wing


@pytest.mark.parametrize("path", sorted(GATEWAY.glob("*.py")), ids=lambda p: p.name)
def test_the_core_imports_no_wing(path: Path) -> None:
    wings = {m for m in imported_modules(path) if wing_of(m)}
    assert not wings, f"gateway/{path.name} (core) imports {sorted(wings)}"


@pytest.mark.parametrize("wing", [w for w in WINGS if w != "cli"])
def test_a_wing_imports_no_other_wing(wing: str) -> None:
    for path in sorted((GATEWAY / wing).glob("*.py")):
        others = {m for m in imported_modules(path) if wing_of(m) not in (None, wing)}
        assert not others, f"gateway/{wing}/{path.name} imports {sorted(others)}"
