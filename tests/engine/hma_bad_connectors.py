"""Built-in connectors with one hybrid-model bug each, for the kit to catch.

Each is a real connector with one rule of serving several KV cache groups
broken, as a connector author could break it.
"""

from __future__ import annotations

from kvwire.config import EngineConfig
from kvwire.connector.base import KVConnectorRole
from kvwire.connectors.block_planner import BlockPlanner
from kvwire.connectors.cpu_offload import CPUOffloadConnector
from kvwire.connectors.shared_storage import SharedStorageConnector
from kvwire.kv_cache_config import KVCacheConfig


class EveryBlockCPUOffloadConnector(CPUOffloadConnector):
    """Saves every block of a sliding-window group, not only those inside its window."""

    def __init__(
        self, config: EngineConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        transfer = self.kv_transfer_config
        self._planner = BlockPlanner(
            self._layout.block_size,
            self._groups,
            loads=transfer.is_kv_consumer,
            saves=transfer.is_kv_producer,
            window_aware=False,
        )


class GroupBlindSharedStorageConnector(SharedStorageConnector):
    """Names every group's entry for a block hash alike, so one group loads another's bytes."""

    def __init__(
        self, config: EngineConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        # The layouts that name entries, without the group in their fingerprint.
        self._group_layouts = tuple(self._layout for _ in self._groups)
