"""The README's marked code blocks, for the tests that run or check them.

A block is marked by an HTML comment on the line before its opening fence::

    <!-- readme-test: NAME -->
    ```bash
    ...
    ```

so that the README shows plain code while the tests run exactly what it shows.
"""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
_BLOCK = re.compile(
    r"^<!-- readme-test: (?P<name>[\w-]+) -->\n```[\w-]*\n(?P<body>.*?)^```$", re.M | re.S
)


def readme_block(name: str) -> str:
    """The body of the one block marked ``name`` (AssertionError unless there is exactly one)."""
    found = [m["body"] for m in _BLOCK.finditer(README.read_text()) if m["name"] == name]
    assert len(found) == 1, f"README.md has {len(found)} blocks marked 'readme-test: {name}'"
    return found[0]
