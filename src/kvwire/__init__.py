"""kvwire: KV-cache connectors for LLM inference engines, built through dependency injection.

This package only re-exports the public names; importing it imports neither
torch nor any connector module.
"""

from kvwire.config import EngineConfig, KVTransferConfig, SchedulerConfig
from kvwire.connector.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
    supports_hma,
)
from kvwire.container import KVConnectorContainer
from kvwire.factory import KVConnectorFactory
from kvwire.kv_cache_config import KVCacheConfig

__all__ = [
    "EngineConfig",
    "KVCacheConfig",
    "KVConnectorBase",
    "KVConnectorContainer",
    "KVConnectorFactory",
    "KVConnectorMetadata",
    "KVConnectorRole",
    "KVTransferConfig",
    "SchedulerConfig",
    "SupportsHMA",
    "supports_hma",
]
