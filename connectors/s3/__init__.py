"""``s3://bucket/prefix`` — any S3-compatible object store, through aioboto3.

- Names (``names.py``): a key becomes ``prefix`` + an injective, readable escape of its UTF-8
  bytes cut into path segments; names of key prefixes are name prefixes, so ``list`` is one
  ListObjectsV2 walk. Keys too long for a 1024-byte name are hashed, the key kept in metadata.
- Atomic puts (``upload.py``): one PutObject up to ``multipart_threshold``, else a multipart
  upload with parts sent in parallel and completed at the end; a failed or cancelled upload is
  aborted, so no partial object is ever visible and no parts are left behind.
- Gets (``download.py``): the first GET's headers give size and ETag, so the caller's buffer
  (``get_into``) is allocated before any byte arrives and each body streams straight into it.
  Over ``ranged_get_threshold`` the rest comes in parallel ranges pinned to that ETag with
  If-Match: an overwrite during a read restarts it, never mixes two versions.
- Timeouts: connect and socket-read timeouts in botocore, and ``request_timeout`` around every
  request; a request moves at most one part or range, so the bound fits any object size.
- Errors (``errors.py``): mapped to kvgate's kinds in one place; messages never hold secrets.
- One client per connector (``client.py``), built on first use, closed by ``close()``.
- Stale multipart uploads (``sweep.py``): the tier's own uploads under the prefix that a dead
  process left are aborted at first use and on a schedule, in a task that ``close()`` cancels.
"""

from connectors.s3.connector import S3Connector

__all__ = ["S3Connector"]
