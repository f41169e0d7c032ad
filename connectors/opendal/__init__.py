"""opendal+<service>://: every Apache OpenDAL service as a tier (see connector.py)."""

from connectors.opendal.connector import OpendalConnector

__all__ = ["OpendalConnector"]
