"""``gs://bucket/prefix`` — Google Cloud Storage, through gcloud-aio-storage (aiohttp).

- Names (``connectors.object_names``, shared with ``s3://`` and ``azure://``): an injective,
  listable escape of the key; keys too long for a 1024-byte name are hashed, the key kept in
  the object's metadata.
- Atomic puts (``upload.py``): one upload up to ``put_threshold`` from views of the caller's
  buffers; above it, up to 32 temporary parts uploaded in parallel and composed into the
  object in one request, so a reader sees the old object or the new one, never a part.
- Gets (``download.py``): the first GET's headers give size and generation, the buffer
  (``get_into``) is allocated then, the body streams into it; a large object's rest comes as
  parallel ranges pinned to that generation.
- Credentials: gcloud-aio-auth's (``service_file``, ``GOOGLE_APPLICATION_CREDENTIALS``, the
  metadata server); an ``endpoint`` (or ``STORAGE_EMULATOR_HOST``) is an emulator, no
  credentials.
- Timeouts: ``request_timeout`` around every request (each moves at most one part or range).
- Errors (``errors.py``): mapped to kvgate's kinds in one place.
"""

from connectors.gcs.connector import GcsConnector

__all__ = ["GcsConnector"]
