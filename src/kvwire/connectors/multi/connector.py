"""MultiConnector: several connectors behind one, e.g. CPU offload in front of shared storage.

Children come from `kv_connector_extra_config["connectors"]`
(`kvwire.connectors.multi._children` reads them and words their errors).
Each child gets its own copy of the engine config and is built by the
`connector_builder` the container that builds the composite hands in
(`kvwire.KVConnectorContainer`), so
its class and its medium are resolved through the container's registry:
provider overrides, module paths and entry points all apply. The hooks
vLLM calls on the class, with no container at hand
(`build_kv_connector_stats`, `build_prom_metrics`,
`get_required_kvcache_layout`, `requires_piecewise_for_cudagraph`), resolve
the children through `kvwire.KVConnectorFactory`, as
vLLM's own composite resolves them through its factory. Each instance
builds its children in its own role and keeps its role's state in one half
(`kvwire.connectors.multi.scheduler` or `kvwire.connectors.multi.worker`), so a
call of the other role raises
`kvwire.exceptions.ConnectorRoleError`; the calls both roles make
(shutdown, binding the step metadata, stats, the children) stay here. What
crosses between the two halves is in `kvwire.connectors.multi.records`;
how a finished request's answers are merged and its sends awaited, in
`kvwire.connectors.multi._finishing`.

Semantics (vLLM's): lookups ask children in order (any None means
"ask again"); the first child with a hit loads, the others get 0; saves go to
every child; worker calls go to every child; a request is finished sending
once every child that kept its blocks reported it; load errors are united,
events chained, stats nested per child, `kv_transfer_params` merged (a key
clash is an error); HMA only when every child supports it. The child that
serves a request's load answers for its hit sources until the request
finishes. The children's worker-side KV cache events are concatenated; the
scheduler half keeps them itself (a child that got them would report them as
its own, each child again) and reports them before its children's own events.
A child's None where vLLM's base answers None (events, stats, finished
transfers, worker metadata) counts as nothing to report.

Every optional hook of the base class reaches the children: preemptions and
worker metadata (one entry per child), new requests, handshakes, the block
pool, the one KV tensor of all layers (preferred only when every child
prefers it, then given to each), each child class's Prometheus metrics.
The rule that no child saves KV computed from a block whose load failed
in another child goes through the base-class hooks
(`kvwire.KVConnectorBase.load_errors_this_step`), so it
holds for any child. Shutdown reaches every child even when one fails; each
failure is logged and the first is raised.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import attrs

from kvwire.config import KVTransferConfig
from kvwire.config.extra_config import ExtraConfigError
from kvwire.connectors.multi._children import (
    any_child_requires_piecewise,
    child_config_error,
    child_names,
    child_transfer_configs,
    children_kv_cache_layout,
    children_prom_metrics,
    children_support_hma,
    validate_children,
)
from kvwire.connectors.multi.records import (
    MultiKVConnectorMetadata,
    MultiKVConnectorStats,
    MultiPromMetrics,
    rebuild_child_stats,
)
from kvwire.connectors.multi.scheduler import MultiSchedulerHalf
from kvwire.connectors.multi.worker import MultiWorkerHalf
from kvwire.factory import KVConnectorFactory
from kvwire.interface.base import (
    ConnectorBuilder,
    ConnectorLookup,
    HMAResolver,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
    metadata_of_type,
)
from kvwire.interface.calls import CallSide, calls_on, forward_calls
from kvwire.interface.roles import RoleSplitConnector
from kvwire.interface.types import (
    CacheHitSource,
    KVConnectorStats,
    Request,
)

if TYPE_CHECKING:
    from kvwire.config import EngineConfig
    from kvwire.config.kv_cache import KVCacheConfig

__all__ = ["MultiConnector"]

logger = logging.getLogger(__name__)


@forward_calls(calls_on(CallSide.SCHEDULER, CallSide.WORKER), to=RoleSplitConnector._half_for)
class MultiConnector(RoleSplitConnector[MultiSchedulerHalf, MultiWorkerHalf], SupportsHMA):
    """Drives every child connector as one; see the module docstring for the rules.

    It builds its children in its own role and only that role's half
    (`MultiSchedulerHalf` or `MultiWorkerHalf`), which takes each call of
    its role as it comes; the calls both roles make (shutdown, the step
    metadata's binding, the stats, the children) and the class-level
    questions are its own.
    """

    def __init__(
        self,
        config: EngineConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
        *,
        connector_builder: ConnectorBuilder,
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        self._children: list[KVConnectorBase] = []
        child_configs = child_transfer_configs(self.kv_transfer_config)
        self._child_names = child_names(child_configs)
        try:
            for index, child_config in enumerate(child_configs):
                child_engine_config = attrs.evolve(config, kv_transfer_config=child_config)
                try:
                    child = connector_builder(child_engine_config, role, kv_cache_config)
                except ExtraConfigError as error:
                    # Worded as validate_extra_config words it, so that
                    # `kvwire check` and the engine report the same text.
                    raise child_config_error(index, error) from error
                self._children.append(child)
        except BaseException:
            # The children built so far are released; their own shutdown
            # errors are logged, and the error that stopped the build is raised.
            self._shutdown_children()
            raise
        owner = type(self).__name__
        if role is KVConnectorRole.SCHEDULER:
            self._set_scheduler_half(MultiSchedulerHalf(owner, self._children, self._child_names))
        else:
            self._set_worker_half(MultiWorkerHalf(owner, self._children, self._child_names))

    @property
    def children(self) -> tuple[KVConnectorBase, ...]:
        return tuple(self._children)

    @property
    def sub_connectors(self) -> list[KVConnectorBase]:
        """The children, as vLLM's MultiConnector names them."""
        return list(self._children)

    @property
    def requires_kv_delivery(self) -> bool:
        return any(child.requires_kv_delivery for child in self._children)

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return bool(self._children) and all(
            child.supports_divergent_local_hybrid_hits for child in self._children
        )

    @property
    def prefer_cross_layer_blocks(self) -> bool:
        """True when every child prefers one tensor of all layers: all of them are given it."""
        return bool(self._children) and all(
            child.prefer_cross_layer_blocks for child in self._children
        )

    @classmethod
    def supports_hma_for_config(
        cls, kv_transfer_config: KVTransferConfig, resolve_child: HMAResolver
    ) -> bool:
        """HMA when every child in kv_connector_extra_config.connectors supports it."""
        return children_support_hma(kv_transfer_config, resolve_child)

    @classmethod
    def validate_extra_config(
        cls, kv_transfer_config: KVTransferConfig, registry: ConnectorLookup
    ) -> None:
        """Its own keys, then each child's through the child's class; stops at the first bad one.

        The constructor stops at the first bad child too, with the same words.
        """
        validate_children(kv_transfer_config, registry)

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> MultiKVConnectorStats | None:
        """Each child's stats rebuilt by its class (see `rebuild_child_stats`).

        A child is named as in `get_kv_connector_stats`.
        """
        return rebuild_child_stats(data, KVConnectorFactory.get_connector_class_by_name)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: EngineConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> MultiPromMetrics:
        """Each child class's metrics (built once per class), fed each child's counters."""
        return MultiPromMetrics(
            children_prom_metrics(
                KVConnectorFactory.get_connector_class,
                vllm_config,
                metric_types,
                labelnames,
                per_engine_labelvalues,
            )
        )

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: EngineConfig) -> str | None:
        """The layout the children need, or None; children needing different ones are an error."""
        return children_kv_cache_layout(KVConnectorFactory.get_connector_class, vllm_config)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return any_child_requires_piecewise(
            KVConnectorFactory.get_connector_class, cls.__name__, extra_config
        )

    # ------------------------------------------------ scheduler calls of its own
    # Every other scheduler-side or worker-side call reaches its half as it came.

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        scheduler = self._scheduler_half("bind_kv_cache_manager")
        self._kv_cache_manager = kv_cache_manager
        scheduler.bind_kv_cache_manager(kv_cache_manager)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        scheduler = self._scheduler_half("get_loaded_kv_cache_group_ids")
        chosen = scheduler.loading_child(request.request_id)
        if chosen is None:
            return super().get_loaded_kv_cache_group_ids(request)
        return chosen.get_loaded_kv_cache_group_ids(request)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        """The tiers of the child serving the request's load, as that child reports them."""
        scheduler = self._scheduler_half("get_external_cache_hit_sources")
        chosen = scheduler.loading_child(request.request_id)
        if chosen is None:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return chosen.get_external_cache_hit_sources(request, num_external_tokens)

    # ------------------------------------------------------------ both roles

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        metadata = metadata_of_type(
            type(self).__name__, connector_metadata, MultiKVConnectorMetadata
        )
        for child, child_metadata in zip(self._children, metadata.children, strict=True):
            child.bind_connector_metadata(child_metadata)
        if self._worker is not None:
            # Only the worker half reports sends finished; its tally holds them back.
            self._worker.expect_finished_sending(metadata.extra_async_saves)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        for child in self._children:
            child.clear_connector_metadata()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        # Both roles: vLLM's scheduler asks its connector too, beside each worker.
        nested = {}
        for name, child in zip(self._child_names, self._children, strict=True):
            stats = child.get_kv_connector_stats()
            if stats is not None and not stats.is_empty():
                nested[name] = stats.reduce()
        return KVConnectorStats(data=nested) if nested else None

    def shutdown(self) -> None:
        first_error = self._shutdown_children()
        if first_error is not None:
            raise first_error

    def _shutdown_children(self) -> Exception | None:
        """Shut every child down, logging each failure; the first failure, or None."""
        first_error: Exception | None = None
        for name, child in zip(self._child_names, self._children, strict=False):
            try:
                child.shutdown()
            except Exception as error:
                logger.exception(
                    "MultiConnector: child %s failed to shut down; shutting down the others", name
                )
                first_error = first_error or error
        return first_error
