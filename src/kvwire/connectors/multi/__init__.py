"""The MultiConnector (`connector`) and the records it exchanges."""

from kvwire.connectors.multi.connector import MultiConnector
from kvwire.connectors.multi.records import (
    MultiKVConnectorMetadata,
    MultiKVConnectorStats,
    MultiKVConnectorWorkerMetadata,
)

__all__ = [
    "MultiConnector",
    "MultiKVConnectorMetadata",
    "MultiKVConnectorStats",
    "MultiKVConnectorWorkerMetadata",
]
