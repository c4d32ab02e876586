"""ByteCounterConnector: counts the KV bytes an engine asks it to save, per layer.

It stores nothing and never loads; it shows the shape of a plugin: derive
from ``KVConnectorBase``, keep the ``(config, role, kv_cache_config)``
constructor, validate your own ``kv_connector_extra_config`` keys, and
declare an entry point in the ``kvwire.connectors`` group.

``kv_connector_extra_config`` keys: ``count_values`` (bool, default true):
count the value half of each layer's KV as well as the key half.
"""

from __future__ import annotations

from typing import Any

from kvwire import (
    EngineConfig,
    KVCacheConfig,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
)
from kvwire.interface.types import (
    ForwardContext,
    KVCacheBlocks,
    KVConnectorStats,
    Request,
    SchedulerOutput,
)


class ByteCounterConnector(KVConnectorBase):
    """Counts saved KV bytes; reports them through ``get_kv_connector_stats``."""

    def __init__(
        self, config: EngineConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        extra = dict(self.kv_transfer_config.kv_connector_extra_config)
        count_values = extra.pop("count_values", True)
        if extra:
            unknown = ", ".join(sorted(extra))
            raise ValueError(
                f"kv_connector_extra_config.{unknown}: unknown key for ByteCounterConnector; "
                "accepted keys are count_values"
            )
        if not isinstance(count_values, bool):
            raise ValueError(
                f"kv_connector_extra_config.count_values: {count_values!r} is not accepted; "
                "expected true or false"
            )
        self._halves = 2 if count_values else 1
        self._saved_bytes: dict[str, int] = {}

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        pass

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        # kv_layer is [2, blocks, ...]: keys then values.
        half = kv_layer[0].numel() * kv_layer.element_size()
        self._saved_bytes[layer_name] = self._saved_bytes.get(layer_name, 0) + half * self._halves

    def wait_for_save(self) -> None:
        pass

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if not self._saved_bytes:
            return None
        stats = KVConnectorStats(data={"saved_bytes": dict(self._saved_bytes)})
        self._saved_bytes = {}
        return stats
