"""``python -m gateway.cli``: the ``kvgate`` command."""

from gateway.cli.app import main

main()
