"""The offload connector (`connector`) and its presets by medium."""

from kvwire.connectors.offload.connector import OffloadConnector
from kvwire.connectors.offload.presets import (
    CPUOffloadConnector,
    RedisConnector,
    SharedStorageConnector,
)

__all__ = [
    "CPUOffloadConnector",
    "OffloadConnector",
    "RedisConnector",
    "SharedStorageConnector",
]
