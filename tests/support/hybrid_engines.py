"""Tiny hybrid engine configs for the hybrid tests, and connectors for the HMA gate."""

from __future__ import annotations

from typing import Any

import attrs

from kvwire.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig
from kvwire.engine.presets import MODEL_PRESETS
from kvwire.interface.base import KVConnectorMetadata, SupportsHMA
from kvwire.interface.types import KVCacheBlocks, Request, SchedulerOutput
from kvwire.testing import IdleConnector

BLOCK_SIZE = 4


def tiny_hybrid_config(
    *,
    num_gpu_blocks: int = 128,
    enable_prefix_caching: bool = True,
    disable_hybrid_kv_cache_manager: bool | None = None,
    max_num_batched_tokens: int = 512,
) -> EngineConfig:
    """The tiny-hybrid preset (layers sliding, full, sliding, full; window 8) on blocks of 4."""
    model = attrs.evolve(MODEL_PRESETS["tiny-hybrid"], vocab_size=300, max_model_len=512)
    return EngineConfig(
        model_config=model,
        cache_config=CacheConfig(
            block_size=BLOCK_SIZE,
            num_gpu_blocks=num_gpu_blocks,
            enable_prefix_caching=enable_prefix_caching,
        ),
        scheduler_config=SchedulerConfig(
            disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager,
            max_num_batched_tokens=max_num_batched_tokens,
        ),
    )


def with_connector(config: EngineConfig, connector: type) -> EngineConfig:
    """``config`` naming ``connector`` (a class importable from its module)."""
    return attrs.evolve(
        config,
        kv_transfer_config=KVTransferConfig(
            kv_connector=connector.__name__,
            kv_connector_module_path=connector.__module__,
            kv_role="kv_both",
        ),
    )


class PlainConnector(IdleConnector):
    """A connector without SupportsHMA: the HMA gate turns HMA off for it."""


class RecordingHMAConnector(IdleConnector, SupportsHMA):
    """An HMA connector that loads and saves nothing and records the block ids it is given."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.allocated: list[tuple[str, tuple[list[int], ...]]] = []
        self.scheduled: list[tuple[str, tuple[list[int], ...]]] = []
        self.finished: list[tuple[str, tuple[list[int], ...]]] = []

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.allocated.append((request.request_id, blocks.get_block_ids()))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        for item in scheduler_output.scheduled:
            self.scheduled.append((item.request_id, item.block_ids))
        return KVConnectorMetadata()

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.finished.append((request.request_id, block_ids))
        return False, None
