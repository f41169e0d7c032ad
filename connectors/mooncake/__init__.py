"""``mooncake://`` — Mooncake Store (see ``connectors.mooncake.connector``)."""

from connectors.mooncake.config import MooncakeOptions
from connectors.mooncake.connector import MooncakeConnector

__all__ = ["MooncakeConnector", "MooncakeOptions"]
