"""kvstore: a tiered KV-cache block store for LLM inference engines.

The core package: block keys and hashing (`keys`), errors, configuration,
the `TieredStore` façade (`store`), the wire protocol and the client.
"""

from kvstore.errors import (
    CapacityError,
    ConfigError,
    KVStoreError,
    NamespaceError,
    ProtocolError,
    TierIOError,
)
from kvstore.keys import BlockHash, ExtraKeys, Namespace, hash_blocks

__all__ = [
    "BlockHash",
    "CapacityError",
    "ConfigError",
    "ExtraKeys",
    "KVStoreError",
    "Namespace",
    "NamespaceError",
    "ProtocolError",
    "TierIOError",
    "hash_blocks",
]
