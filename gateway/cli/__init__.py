"""The ``kvgate`` command: ``serve``, ``bench``, ``connectors`` (``app``) and the object
commands ``put``, ``get``, ``stat``, ``ls`` (``objects``). The one wing that starts the others.
"""

from gateway.cli.app import app, main

__all__ = ["app", "main"]
