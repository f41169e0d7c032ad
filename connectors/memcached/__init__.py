"""``memcached://`` — kvgate objects on a memcached server (see ``connector``)."""

from connectors.memcached.connector import MemcachedConnector

__all__ = ["MemcachedConnector"]
