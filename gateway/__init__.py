"""kvgate: an asyncio object-store gateway for LLM KV-cache chunks.

```python
from gateway import Store, Key

async with Store() as store:          # embedded default: memory + local disk tiers
    await store.put(key, tensor)
    tensor = await store.get(key)
```
"""

from gateway.config import StoreConfig, TierConfig, load_config
from gateway.errors import (
    CapacityError,
    CircuitOpen,
    ConfigError,
    CorruptObject,
    GatewayError,
    IncompleteDelete,
    InvalidKey,
    InvalidObject,
    MissingDependency,
    NotFound,
    Timeout,
    Unavailable,
    Unsupported,
)
from gateway.keys import Chunker, Key, normalize_key
from gateway.store import Store
from gateway.types import Capabilities, MemoryFormat, ObjectInfo, TierStats

Config = StoreConfig

__all__ = [
    "Capabilities",
    "CapacityError",
    "Chunker",
    "CircuitOpen",
    "Config",
    "ConfigError",
    "CorruptObject",
    "GatewayError",
    "IncompleteDelete",
    "InvalidKey",
    "InvalidObject",
    "Key",
    "MemoryFormat",
    "MissingDependency",
    "NotFound",
    "ObjectInfo",
    "Store",
    "StoreConfig",
    "TierConfig",
    "TierStats",
    "Timeout",
    "Unavailable",
    "Unsupported",
    "load_config",
    "normalize_key",
]
