"""A connector written against vLLM's ``KVConnectorBase_V1`` runs under kvwire with new imports.

``VllmStyleConnector`` below is written as vLLM's own connectors are: keyword
``super().__init__``, ``self._vllm_config`` / ``self._kv_transfer_config``,
optional hooks overridden or left to the base's defaults. The surface list
is vLLM 0.32's ``KVConnectorBase_V1`` (plus ``prefer_cross_layer_blocks`` and
``register_cross_layers_kv_cache`` of the releases just before it), with
each method's parameter names, since vLLM calls some of them by keyword.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from dependency_injector import providers

from kvwire.config import EngineConfig
from kvwire.config.kv_cache import KVCacheConfig
from kvwire.container import KVConnectorContainer
from kvwire.interface.base import (
    KVConnectorBase,
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from kvwire.interface.types import (
    CacheHitSource,
    ForwardContext,
    KVCacheBlocks,
    KVConnectorTransferResults,
    Request,
    SchedulerOutput,
)
from kvwire.registry import ConnectorRegistry


class VllmStyleMetadata(KVConnectorMetadata):
    pass


class VllmStyleConnector(KVConnectorBase_V1):
    """Written as vLLM's connectors are; only its imports name kvwire."""

    def __init__(
        self, vllm_config: EngineConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.block_size = self._vllm_config.cache_config.block_size
        self.storage_path = self._kv_transfer_config.get_from_extra_config("path", "/tmp")
        self.preempted: list[KVConnectorMetadata] = []
        self.block_pools: list[object] = []

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        pass

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return VllmStyleMetadata()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self.preempted.append(kv_connector_metadata)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self.block_pools.append(gpu_block_pool)


@pytest.fixture
def connector(
    registry: ConnectorRegistry,
    make_engine_config: Any,
    kv_cache_config: KVCacheConfig,
) -> Any:
    container = KVConnectorContainer()
    container.registry.override(providers.Object(registry))
    container.engine_config.override(
        providers.Object(make_engine_config("RecordingConnector", kv_connector_extra_config={}))
    )
    container.kv_cache_config.override(providers.Object(kv_cache_config))
    container.connector_class.override(providers.Object(VllmStyleConnector))
    built = container.worker_connector()
    yield built
    container.shutdown_resources()


def test_the_base_constructor_takes_vllm_s_keywords(connector: VllmStyleConnector) -> None:
    assert connector.role is KVConnectorRole.WORKER
    assert connector.block_size == 16
    assert connector.storage_path == "/tmp"


def test_the_base_keeps_the_attributes_vllm_connectors_read(
    connector: VllmStyleConnector, kv_cache_config: KVCacheConfig
) -> None:
    assert connector._vllm_config is connector.engine_config
    assert connector._kv_transfer_config is connector.engine_config.kv_transfer_config
    assert connector._kv_cache_config is kv_cache_config


def test_an_overridden_hook_is_the_connector_s_own(connector: VllmStyleConnector) -> None:
    metadata = VllmStyleMetadata()

    connector.handle_preemptions(kv_connector_metadata=metadata)

    assert connector.preempted == [metadata]


VLLM_BASE_SURFACE: dict[str, tuple[str, ...] | None] = {
    # name: parameter names after self/cls, or None for a property
    "__init__": ("vllm_config", "role", "kv_cache_config"),
    "role": None,
    "requires_kv_delivery": None,
    "supports_divergent_local_hybrid_hits": None,
    "prefer_cross_layer_blocks": None,
    "bind_connector_metadata": ("connector_metadata",),
    "clear_connector_metadata": (),
    "has_connector_metadata": (),
    "register_kv_caches": ("kv_caches",),
    "register_cross_layers_kv_cache": ("kv_cache", "attn_backend"),
    "get_mem_pool_context": (),
    "set_host_xfer_buffer_ops": ("copy_operation",),
    "finish_forward": (),
    "reset_capture_state": (),
    "handle_preemptions": ("kv_connector_metadata",),
    "start_load_kv": ("forward_context", "kwargs"),
    "wait_for_layer_load": ("layer_name",),
    "save_kv_layer": ("layer_name", "kv_layer", "attn_metadata", "kwargs"),
    "wait_for_save": (),
    "get_finished": ("finished_req_ids",),
    "get_transfer_results": ("finished_req_ids",),
    "get_block_ids_with_load_errors": (),
    "shutdown": (),
    "get_kv_connector_stats": (),
    "get_kv_connector_kv_cache_events": (),
    "get_handshake_metadata": (),
    "build_connector_worker_meta": (),
    "bind_kv_cache_manager": ("kv_cache_manager",),
    "bind_gpu_block_pool": ("gpu_block_pool",),
    "get_loaded_kv_cache_group_ids": ("request",),
    "get_num_new_matched_tokens": ("request", "num_computed_tokens"),
    "get_external_cache_hit_sources": ("request", "num_external_tokens"),
    "update_state_after_alloc": ("request", "blocks", "num_external_tokens"),
    "build_connector_meta": ("scheduler_output",),
    "on_new_request": ("request",),
    "update_connector_output": ("connector_output",),
    "request_finished": ("request", "block_ids"),
    "register_finished_partial_tail": ("request", "block_ids", "partial_tail_offloads"),
    "take_events": (),
    "has_pending_block_frees": (),
    "has_pending_push_work": (),
    "get_required_kvcache_layout": ("vllm_config",),
    "requires_piecewise_for_cudagraph": ("extra_config",),
    "get_finished_count": (),
    "build_kv_connector_stats": ("data",),
    "set_xfer_handshake_metadata": ("metadata",),
    "set_xfer_handshake_metadata_pp_aware": ("metadata",),
    "build_prom_metrics": ("vllm_config", "metric_types", "labelnames", "per_engine_labelvalues"),
    "reset_cache": (),
}


@pytest.mark.parametrize("name", sorted(VLLM_BASE_SURFACE))
def test_the_base_has_each_vllm_method_with_its_parameter_names(name: str) -> None:
    member = inspect.getattr_static(KVConnectorBase, name)
    expected = VLLM_BASE_SURFACE[name]

    if expected is None:
        assert isinstance(member, property)
    else:
        function = member.__func__ if isinstance(member, classmethod) else member
        assert tuple(inspect.signature(function).parameters)[1:] == expected


def test_kv_connector_base_v1_is_kvwire_s_base() -> None:
    assert KVConnectorBase_V1 is KVConnectorBase


def request() -> Request:
    return Request("r", [1, 2, 3], max_tokens=4)


def test_the_worker_hooks_default_to_doing_nothing(connector: VllmStyleConnector) -> None:
    assert connector.build_connector_worker_meta() is None
    assert connector.get_mem_pool_context() is None
    assert connector.set_host_xfer_buffer_ops(lambda *args: None) is None
    assert connector.register_cross_layers_kv_cache(object(), object()) is None
    assert connector.finish_forward() is None
    assert connector.reset_capture_state() is None


def test_the_scheduler_hooks_default_as_in_vllm(
    connector: VllmStyleConnector, kv_cache_config: KVCacheConfig
) -> None:
    assert connector.on_new_request(request()) is None
    assert connector.get_finished_count() is None
    assert connector.has_pending_block_frees() is False
    assert connector.has_pending_push_work() is False
    assert connector.register_finished_partial_tail(request(), ([1],), []) is False
    assert connector.get_loaded_kv_cache_group_ids(request()) == tuple(
        range(len(kv_cache_config.kv_cache_groups))
    )
    assert connector.build_prom_metrics(connector.engine_config, {}, [], {}) is None


def test_cross_layer_blocks_and_divergent_hits_are_not_preferred_by_default(
    connector: VllmStyleConnector,
) -> None:
    assert connector.prefer_cross_layer_blocks is False
    assert connector.supports_divergent_local_hybrid_hits is False


@pytest.mark.parametrize(
    ("kv_role", "delivers"), [("kv_producer", True), ("kv_both", True), ("kv_consumer", False)]
)
def test_kv_delivery_is_required_of_a_producer(
    kv_role: str, delivers: bool, make_engine_config: Any, kv_cache_config: KVCacheConfig
) -> None:
    config = make_engine_config("VllmStyleConnector", kv_role=kv_role)

    built = VllmStyleConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config)

    assert built.requires_kv_delivery is delivers


def test_no_layout_is_required_by_a_connector_but_the_base_refuses_to_answer(
    connector: VllmStyleConnector,
) -> None:
    assert VllmStyleConnector.get_required_kvcache_layout(connector.engine_config) is None
    with pytest.raises(TypeError, match="should not be called on the abstract base class"):
        KVConnectorBase.get_required_kvcache_layout(connector.engine_config)


def test_piecewise_cuda_graphs_are_not_required_by_default() -> None:
    assert VllmStyleConnector.requires_piecewise_for_cudagraph({}) is False


def test_transfer_results_default_to_what_get_finished_reports(
    connector: VllmStyleConnector,
) -> None:
    assert connector.get_transfer_results({"r"}) == KVConnectorTransferResults()


def test_every_external_hit_counts_under_the_connector_s_source(
    connector: VllmStyleConnector,
) -> None:
    assert connector.get_external_cache_hit_sources(request(), 0) == {}
    assert connector.get_external_cache_hit_sources(request(), 12) == {
        CacheHitSource.EXTERNAL_UNSPECIFIED: 12
    }


def test_binding_the_kv_cache_manager_binds_its_block_pool(
    connector: VllmStyleConnector,
) -> None:
    class Manager:
        block_pool = object()

    manager = Manager()
    connector.bind_kv_cache_manager(manager)

    assert connector._kv_cache_manager is manager
    assert connector.block_pools == [manager.block_pool]


def test_handshake_metadata_of_a_later_pipeline_rank_is_refused_by_default(
    connector: VllmStyleConnector,
) -> None:
    with pytest.raises(ValueError, match="VllmStyleConnector got handshake metadata for a pipe"):
        connector.set_xfer_handshake_metadata_pp_aware({(1, 0): object()})  # type: ignore[dict-item]


def test_no_load_error_is_known_and_no_save_skipped_by_default(
    connector: VllmStyleConnector,
) -> None:
    assert connector.load_errors_this_step() == set()
    assert connector.skip_saves_computed_from({1, 2}) is None
