"""``azure://account/container/prefix`` — Azure Blob Storage, through azure-storage-blob (aio).

- Names (``connectors.object_names``, shared with ``s3://``): a key becomes ``prefix`` + an
  injective escape of its UTF-8 bytes cut into path segments, so ``list`` is one walk by name
  prefix; keys too long for a 1024-character name are hashed, the key kept in metadata.
- Atomic puts (``transfer.py``): one Put Blob up to ``put_threshold``; above it, block blobs
  staged in parallel under block ids unique to the put and committed by one Put Block List,
  so a reader sees the old blob or the new one, never a part.
- Gets (``transfer.py``): the first GET gives size and ETag, the buffer (``get_into``) is
  allocated then, and the rest comes as parallel ranges pinned to that ETag; an overwrite
  during a read restarts it.
- Credentials (``config.py``): a connection string, an account key or a SAS, from options or
  the ``AZURE_STORAGE_*`` environment; never shown (``errors.scrub``, ``SecretStr``).
- Timeouts: socket connect and read timeouts in the client, ``request_timeout`` around every
  call; the SDK's own retries are off (the tier retries).
- Errors (``errors.py``): mapped to kvgate's kinds in one place.
"""

from connectors.azure.connector import AzureConnector

__all__ = ["AzureConnector"]
