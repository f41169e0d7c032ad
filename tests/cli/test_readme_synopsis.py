"""The README's CLI synopsis is complete and names nothing the ``kvgate`` command lacks.

Every command of ``kvgate`` has a line in the synopsis (``kvgate bench codecs`` included), and
every option of a command appears on its line by one of its names; an option written there
that the command does not have fails too. ``[CLIENT]`` stands for the client options the
synopsis spells out once (``# CLIENT: ...``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from itertools import takewhile
from typing import Any

import typer
from readme_blocks import readme_block

from gateway.cli import app

OPTION = re.compile(r"(?<![\w-])(--?[a-z][a-z-]*)")


def commands(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, Any]]:
    """Every command under ``command`` by its path (``"bench codecs"``), groups included."""
    if path:
        yield " ".join(path), command
    for name, sub in getattr(command, "commands", {}).items():
        yield from commands(sub, (*path, name))


def option_names(command: Any) -> list[set[str]]:
    """Each option's names (``{"--count", "-n"}``), ``--help`` aside."""
    return [
        {*p.opts, *p.secondary_opts}
        for p in command.params
        if p.param_type_name == "option" and p.name != "help"
    ]


def synopsis() -> dict[str, str]:
    """The synopsis' text per command path, ``[CLIENT]`` expanded, comments dropped."""
    lines: dict[str, list[str]] = {}
    client = ""
    current: list[str] = []
    for line in readme_block("synopsis").splitlines():
        code, _, comment = line.partition("#")
        if comment.strip().startswith("CLIENT:"):
            client = comment.strip().removeprefix("CLIENT:")
            continue
        if line.startswith("kvgate "):
            words = takewhile(lambda word: re.fullmatch(r"[a-z]+", word), code.split()[1:])
            current = lines.setdefault(" ".join(words), [])
        current.append(code)
    return {path: " ".join(text).replace("[CLIENT]", client) for path, text in lines.items()}


def test_every_command_and_option_is_in_the_readme_synopsis() -> None:
    written = synopsis()
    cli = dict(commands(typer.main.get_command(app)))
    assert sorted(written) == sorted(cli)
    for path, command in cli.items():
        shown = set(OPTION.findall(written[path]))
        options = option_names(command)
        missing = [sorted(names) for names in options if not names & shown]
        assert not missing, f"kvgate {path}: options not in the README synopsis: {missing}"
        unknown = shown - set().union(*options)
        assert not unknown, f"kvgate {path}: the README synopsis names {sorted(unknown)}"
