"""`ForwardingConnector`: a connector around another one, passing every call on to it.

A wrapper that changes a few calls of a connector (injects faults, records
them, translates what crosses) derives from it and overrides only those:
every other call of the interface reaches the wrapped connector unchanged,
including a call the interface gains later, since this class forwards each
one (a test checks it against [`KVConnectorBase`][kvwire.KVConnectorBase]).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from kvwire.interface.base import (
    ConnectorLookup,
    CopyBlocksOp,
    HMAResolver,
    KVConnectorBase,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
    supports_hma,
)
from kvwire.interface.types import (
    CacheHitSource,
    ForwardContext,
    KVCacheBlocks,
    KVCacheEvent,
    KVConnectorOutput,
    KVConnectorStats,
    KVConnectorTransferResults,
    Request,
    SchedulerOutput,
)

if TYPE_CHECKING:
    import torch

    from kvwire.config import EngineConfig, KVTransferConfig
    from kvwire.config.kv_cache import KVCacheConfig

__all__ = ["ForwardingConnector"]


class ForwardingConnector(KVConnectorBase, SupportsHMA):
    """A connector of one role around `inner`, a connector of the same role, built by the subclass.

    Each instance-level call goes to `inner` as it came; each class-level
    question (HMA support, extra-config validation, the KV cache layout,
    piecewise CUDA graphs, stats, metrics) to the class `wrapped`, so that
    the engine sees the wrapped connector's answers. The wrapper keeps the
    step's metadata and the KV cache manager it is given, as any connector
    does, and hands them on too.

    It serves HMA exactly when `wrapped` does (the HMA gate asks
    `supports_hma_for_config`); with HMA off, `request_finished_all_groups`
    reaches `inner` as `request_finished` with the one group's blocks.
    """

    wrapped: ClassVar[type[KVConnectorBase]]
    """The class of `inner`: the subclass sets it (a class made per wrapped class)."""

    def __init__(
        self,
        vllm_config: EngineConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
        *,
        inner: KVConnectorBase,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.inner = inner
        """The wrapped connector, built for the same role."""

    def _inner_metadata(self, metadata: KVConnectorMetadata) -> KVConnectorMetadata:
        """The step metadata `inner` gets for `metadata`, built by this scheduler half.

        `metadata` itself; a wrapper whose `build_connector_meta` wraps
        `inner`'s metadata in its own returns `inner`'s here.
        """
        return metadata

    # ------------------------------------------------------- class questions

    @classmethod
    def supports_hma_for_config(
        cls, kv_transfer_config: KVTransferConfig, resolve_child: HMAResolver
    ) -> bool:
        return cls.wrapped.supports_hma_for_config(kv_transfer_config, resolve_child)

    @classmethod
    def validate_extra_config(
        cls, kv_transfer_config: KVTransferConfig, registry: ConnectorLookup
    ) -> None:
        cls.wrapped.validate_extra_config(kv_transfer_config, registry)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: EngineConfig) -> str | None:
        return cls.wrapped.get_required_kvcache_layout(vllm_config)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return cls.wrapped.requires_piecewise_for_cudagraph(extra_config)

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return cls.wrapped.build_kv_connector_stats(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: EngineConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        return cls.wrapped.build_prom_metrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )

    @property
    def requires_kv_delivery(self) -> bool:
        return self.inner.requires_kv_delivery

    @property
    def prefer_cross_layer_blocks(self) -> bool:
        return self.inner.prefer_cross_layer_blocks

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return self.inner.supports_divergent_local_hybrid_hits

    # ------------------------------------------------------------ worker half

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.inner.register_kv_caches(kv_caches)

    def register_cross_layers_kv_cache(self, kv_cache: torch.Tensor, attn_backend: Any) -> None:
        self.inner.register_cross_layers_kv_cache(kv_cache, attn_backend)

    def get_mem_pool_context(self) -> contextlib.AbstractContextManager[Any] | None:
        return self.inner.get_mem_pool_context()

    def set_host_xfer_buffer_ops(self, copy_operation: CopyBlocksOp) -> None:
        self.inner.set_host_xfer_buffer_ops(copy_operation)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self.inner.handle_preemptions(self._inner_metadata(kv_connector_metadata))

    def finish_forward(self) -> None:
        self.inner.finish_forward()

    def reset_capture_state(self) -> None:
        self.inner.reset_capture_state()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        inner_metadata = self._inner_metadata(connector_metadata)  # refuses a stranger's first
        super().bind_connector_metadata(connector_metadata)
        self.inner.bind_connector_metadata(inner_metadata)

    def clear_connector_metadata(self) -> None:
        self.inner.clear_connector_metadata()
        super().clear_connector_metadata()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.inner.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.inner.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self.inner.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        self.inner.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.inner.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self.inner.get_transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.inner.get_block_ids_with_load_errors()

    def load_errors_this_step(self) -> set[int]:
        return self.inner.load_errors_this_step()

    def skip_saves_computed_from(self, block_ids: set[int]) -> None:
        self.inner.skip_saves_computed_from(block_ids)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self.inner.get_kv_connector_stats()

    def get_kv_connector_kv_cache_events(self) -> list[KVCacheEvent]:
        return self.inner.get_kv_connector_kv_cache_events()

    def wait_for_pending_saves(self, timeout_s: float | None = None) -> bool:
        return self.inner.wait_for_pending_saves(timeout_s)

    def get_handshake_metadata(self) -> Any:
        return self.inner.get_handshake_metadata()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.inner.build_connector_worker_meta()

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        self.inner.set_xfer_handshake_metadata(metadata)

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        self.inner.set_xfer_handshake_metadata_pp_aware(metadata)

    def shutdown(self) -> None:
        self.inner.shutdown()

    # --------------------------------------------------------- scheduler half

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        # Not the base's: it would bind the block pool here, and `inner` binds it itself.
        self._kv_cache_manager = kv_cache_manager
        self.inner.bind_kv_cache_manager(kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self.inner.bind_gpu_block_pool(gpu_block_pool)

    def on_new_request(self, request: Request) -> None:
        self.inner.on_new_request(request)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return self.inner.get_loaded_kv_cache_group_ids(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.inner.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.inner.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.inner.build_connector_meta(scheduler_output)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        return self.inner.get_external_cache_hit_sources(request, num_external_tokens)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.inner.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.inner.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if supports_hma(self.inner):
            finished: tuple[bool, dict[str, Any] | None] = self.inner.request_finished_all_groups(  # type: ignore[attr-defined]
                request, block_ids
            )
            return finished
        # The HMA gate gives a connector without HMA one group.
        return self.inner.request_finished(request, block_ids[0])

    def register_finished_partial_tail(
        self,
        request: Request,
        block_ids: tuple[list[int], ...],
        partial_tail_offloads: list[tuple[int, int, int]],
    ) -> bool:
        return self.inner.register_finished_partial_tail(request, block_ids, partial_tail_offloads)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self.inner.take_events()

    def has_pending_block_frees(self) -> bool:
        return self.inner.has_pending_block_frees()

    def has_pending_push_work(self) -> bool:
        return self.inner.has_pending_push_work()

    def get_finished_count(self) -> int | None:
        return self.inner.get_finished_count()

    def reset_cache(self) -> bool | None:
        return self.inner.reset_cache()
