"""The ``kvgate`` command."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from gateway.cli.bench import register as register_bench
from gateway.cli.calibrate import register as register_calibrate
from gateway.cli.objects import register as register_object_commands
from gateway.cli.serve import register as register_serve
from gateway.malloc_thresholds import steady_malloc_thresholds
from gateway.registry import codec_status, connector_status

app = typer.Typer(add_completion=False, no_args_is_help=True, help="kvgate: KV-cache gateway")
err = Console(stderr=True)


@app.command()
def connectors(
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object")] = False,
) -> None:
    """List registered connectors and codecs, and whether each is usable here."""
    rows = {"connectors": connector_status(), "codecs": codec_status()}
    if as_json:
        print(
            json.dumps(
                {
                    k: [vars(s) if hasattr(s, "__dict__") else _status_dict(s) for s in v]
                    for k, v in rows.items()
                }
            )
        )
        return
    for title, statuses in rows.items():
        table = Table(title=title)
        for col in ("name", "usable", "provided by", "problem"):
            table.add_column(col)
        for s in statuses:
            table.add_row(
                s.name, "yes" if s.usable else "no", f"{s.distribution} ({s.target})", s.problem
            )
        Console().print(table)


def _status_dict(s: object) -> dict[str, object]:
    return {f: getattr(s, f) for f in ("name", "target", "distribution", "usable", "problem")}


# The commands in the order --help lists them: the store bench, the service, then put, get,
# stat and ls (clients of a running gateway).
register_bench(app)
register_serve(app)
register_object_commands(app)
register_calibrate(app)


def main() -> None:
    # Before any command allocates: see gateway.malloc_thresholds for why.
    steady_malloc_thresholds()
    app()


if __name__ == "__main__":
    main()
