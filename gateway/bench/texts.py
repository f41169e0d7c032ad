"""English texts that ship with every machine this runs on, to run a real model over.

Two kinds, both always there: Debian's licence texts (``/usr/share/common-licenses``, from the
``base-files`` package, which no Debian system lacks) and the ``pydoc`` pages of Python
standard-library modules (rendered in-process, so they exist wherever Python does). Man pages
are not used: slim images drop them, and their rendering depends on groff and the terminal.

The choice is fixed, so that figures compare across runs and machines: a calibration set and a
test set that share no document (nor a near-copy: the GPL-2 family overlaps heavily, so it is
all on one side). A caller takes the first N of a set.
"""

from __future__ import annotations

import importlib
import pydoc
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Split = Literal["calibration", "test"]
LICENSES = Path("/usr/share/common-licenses")


@dataclass(frozen=True)
class Text:
    name: str  # "license:GPL-3" or "pydoc:json"

    def read(self) -> str:
        kind, _, what = self.name.partition(":")
        if kind == "license":
            path = LICENSES / what
            if not path.is_file():
                raise FileNotFoundError(f"{path} is missing (Debian's base-files ship it)")
            return path.read_text(encoding="utf-8")
        if kind == "pydoc":
            return _pydoc_page(what)
        raise ValueError(f"unknown text kind {kind!r}")


# Each text is long enough for its use: calibration texts >= 2048 tokens of SmolLM2's
# tokenizer, test texts >= 1536 (a 1024-token prefix and 512 tokens to continue). Licence and
# pydoc texts alternate so that taking the first two gives one of each.
CALIBRATION = (
    Text("license:GPL-3"),  # 7.7k tokens
    Text("pydoc:argparse"),  # 7.0k
    Text("license:LGPL-2.1"),  # 5.9k
    Text("pydoc:collections"),  # 13.7k
)
TEST = (
    Text("license:Apache-2.0"),  # 2.2k
    Text("pydoc:json"),  # 5.9k
    Text("license:MPL-2.0"),  # 3.7k
    Text("pydoc:subprocess"),  # 5.3k
)


def texts(split: Split) -> tuple[Text, ...]:
    if split == "calibration":
        return CALIBRATION
    if split == "test":
        return TEST
    raise ValueError(f"split must be calibration or test, not {split!r}")


def _pydoc_page(module: str) -> str:
    """``pydoc MODULE`` as plain text, without the FILE section: the module's path differs
    between machines and would change the tokens."""
    page = pydoc.plain(pydoc.render_doc(importlib.import_module(module)))
    return re.sub(r"\nFILE\n(?:    .*\n)+", "\n", page)
