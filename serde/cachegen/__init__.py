"""The ``cachegen`` codec (``codec.py``): its step model (``model.py``), entropy tables
(``tables.py``) and payload format (``format.py``); the kernels are in ``gpu/``."""

from serde.cachegen.codec import CacheGenCodec

__all__ = ["CacheGenCodec"]
