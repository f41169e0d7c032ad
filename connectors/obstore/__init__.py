"""``obstore+s3://bucket/prefix``: S3 through obstore, a Rust client (see connector.py)."""

from connectors.obstore.connector import ObstoreS3Connector

__all__ = ["ObstoreS3Connector"]
