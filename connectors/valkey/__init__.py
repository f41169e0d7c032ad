"""Valkey connector (``valkey://``, ``valkeys://``, ``valkey+cluster://``) on valkey-glide.

See ``connectors.valkey.connector`` for the design.
"""

from connectors.valkey.config import ValkeyOptions
from connectors.valkey.connector import ValkeyConnector

__all__ = ["ValkeyConnector", "ValkeyOptions"]
