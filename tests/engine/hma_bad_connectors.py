"""Built-in connectors with one hybrid-model bug each, for the kit to catch.

Each is a real connector with one rule of serving several KV cache groups
broken, as a connector author could break it.
"""

from __future__ import annotations

from typing import Any

from kvwire.config import EngineConfig
from kvwire.connector.base import KVConnectorRole
from kvwire.connectors.block_planner import BlockPlanner
from kvwire.connectors.cache_groups import NULL_BLOCK_ID
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


class NullBlockWritingCPUOffloadConnector(CPUOffloadConnector):
    """Writes KV into the null block (id 0) as each layer loads, as a loader copying every
    position of a sliding-window group would.

    Attention never reads the positions the null block stands for, so outputs stay
    equal: only the KV itself shows it.
    """

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        self._caches = kv_caches

    def wait_for_layer_load(self, layer_name: str) -> None:
        super().wait_for_layer_load(layer_name)
        cache = self._caches[layer_name]
        cache[:, NULL_BLOCK_ID] = cache[:, NULL_BLOCK_ID + 1]
