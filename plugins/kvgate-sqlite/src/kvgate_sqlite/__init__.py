"""kvgate-sqlite: a kvgate connector in its own distribution (the plugin example to copy).

It registers the ``sqlite`` URL scheme through the ``kvgate.connectors`` entry point in its
pyproject.toml, and imports only kvgate's public contract modules: ``gateway.connector``,
``gateway.errors``, ``gateway.types`` (and ``gateway.testing`` in its tests).
"""

from kvgate_sqlite.connector import SqliteConnector

__all__ = ["SqliteConnector"]
