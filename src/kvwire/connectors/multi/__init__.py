"""MultiConnector: several connectors behind one, e.g. CPU offload in front of shared storage.

Children come from ``kv_connector_extra_config["connectors"]``
(:mod:`kvwire.connectors.multi._children` reads them and words their errors).
Each child gets its own copy of the engine config and is built by the
``connector_builder`` the container (or the factory) hands in, so it
resolves through the same registry: provider overrides, module paths and
entry points all apply. What crosses between the two halves is in
:mod:`kvwire.connectors.multi._records`; how a finished request's answers are
merged and its sends awaited, in :mod:`kvwire.connectors.multi._finishing`.

Semantics (the reference's): lookups ask children in order (any None means
"ask again"); the first child with a hit loads, the others get 0; saves go to
every child; worker calls go to every child; a request is finished sending
once every child that kept its blocks reported it; load errors are united,
events chained, stats nested per child, ``kv_transfer_params`` merged (a key
clash is an error); HMA only when every child supports it. The child that
serves a request's load answers for its hit sources until the request
finishes. The children's worker-side KV cache events are concatenated; the
scheduler side keeps them itself (a child that got them would report them as
its own, each child again) and reports them before its children's own events.
A child's None where vLLM's base answers None (events, stats, finished
transfers, worker metadata) counts as nothing to report.

Every optional hook of the base class reaches the children: preemptions and
worker metadata (one entry per child), new requests, handshakes, the block
pool. The rule that no child saves KV computed from a block whose load failed
in another child goes through the base-class hooks
(:meth:`~kvwire.connector.base.KVConnectorBase.load_errors_this_step`), so it
holds for any child. Shutdown reaches every child even when one fails; each
failure is logged and the first is raised.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

from kvwire.config import KVTransferConfig
from kvwire.connector.base import (
    ConnectorBuilder,
    ConnectorResolver,
    CopyBlocksOp,
    HMAResolver,
    KVConnectorBase,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
    supports_hma,
)
from kvwire.connector.types import (
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
from kvwire.connector.worker_steps import metadata_of_type
from kvwire.connectors.multi._children import (
    any_child_requires_piecewise,
    child_config_error,
    child_transfer_configs,
    children_kv_cache_layout,
    children_support_hma,
    validate_children,
)
from kvwire.connectors.multi._finishing import FinishedSendingTally, merge_finished_answers
from kvwire.connectors.multi._records import (
    MultiKVConnectorMetadata,
    MultiKVConnectorStats,
    MultiKVConnectorWorkerMetadata,
    per_child_worker_meta,
    rebuild_child_stats,
)
from kvwire.extra_config import ExtraConfigError

if TYPE_CHECKING:
    import torch

    from kvwire.config import EngineConfig
    from kvwire.kv_cache_config import KVCacheConfig

__all__ = [
    "MultiConnector",
    # Re-exported: their home moved to multi_records, and callers import them from here.
    "MultiKVConnectorMetadata",
    "MultiKVConnectorStats",
    "MultiKVConnectorWorkerMetadata",
]

logger = logging.getLogger(__name__)


class MultiConnector(KVConnectorBase, SupportsHMA):
    """Drives every child connector as one; see the module docstring for the rules."""

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
        self._child_names: list[str] = []
        try:
            for index, child_config in enumerate(child_transfer_configs(self.kv_transfer_config)):
                child_engine_config = attrs.evolve(config, kv_transfer_config=child_config)
                try:
                    child = connector_builder(child_engine_config, role, kv_cache_config)
                except ExtraConfigError as error:
                    # Worded as validate_extra_config words it, so that
                    # `kvwire check` and the engine report the same text.
                    raise child_config_error(index, error) from error
                self._children.append(child)
                name = str(child_config.kv_connector)
                self._child_names.append(
                    name if name not in self._child_names else f"{name}#{len(self._child_names)}"
                )
        except BaseException:
            # The children built so far are released; their own shutdown
            # errors are logged, and the error that stopped the build is raised.
            self._shutdown_children()
            raise
        # Scheduler side. The index of the child serving a request's load, by
        # request id: chosen at lookup, kept until the request finishes.
        self._loading_child: dict[str, int] = {}
        self._extra_async_saves: dict[str, int] = {}
        self._worker_events: list[KVCacheEvent] = []
        # Worker side.
        self._finished_sending = FinishedSendingTally()

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

    @classmethod
    def supports_hma_for_config(
        cls, kv_transfer_config: KVTransferConfig, resolve_child: HMAResolver
    ) -> bool:
        """HMA when every child in kv_connector_extra_config.connectors supports it."""
        return children_support_hma(kv_transfer_config, resolve_child)

    @classmethod
    def validate_extra_config(
        cls, kv_transfer_config: KVTransferConfig, resolve_child: ConnectorResolver
    ) -> None:
        """Its own keys, then each child's through the child's class; stops at the first bad one.

        The constructor stops at the first bad child too, with the same words.
        """
        validate_children(kv_transfer_config, resolve_child)

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> MultiKVConnectorStats | None:
        """Each child's stats rebuilt by its class (see :func:`rebuild_child_stats`).

        A child is named as in :meth:`get_kv_connector_stats`.
        """
        return rebuild_child_stats(data)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: EngineConfig) -> str | None:
        """The layout the children need, or None; children needing different ones are an error."""
        return children_kv_cache_layout(vllm_config)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return any_child_requires_piecewise(cls.__name__, extra_config)

    # -------------------------------------------------------- scheduler side

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self._kv_cache_manager = kv_cache_manager
        for child in self._children:
            child.bind_kv_cache_manager(kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        for child in self._children:
            child.bind_gpu_block_pool(gpu_block_pool)

    def on_new_request(self, request: Request) -> None:
        for child in self._children:
            child.on_new_request(request)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        chosen = self._loading_child.get(request.request_id)
        if chosen is None:
            return super().get_loaded_kv_cache_group_ids(request)
        return self._children[chosen].get_loaded_kv_cache_group_ids(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        answer: tuple[int | None, bool] = (0, False)
        chosen = None
        for index, child in enumerate(self._children):
            tokens, load_async = child.get_num_new_matched_tokens(request, num_computed_tokens)
            if tokens is None:
                self._loading_child.pop(request.request_id, None)
                return None, False
            if chosen is None and tokens > 0:
                chosen = index
                answer = (tokens, load_async)
        if chosen is None:
            self._loading_child.pop(request.request_id, None)
        else:
            self._loading_child[request.request_id] = chosen
        return answer

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        chosen = self._loading_child.get(request.request_id)
        for index, child in enumerate(self._children):
            tokens = num_external_tokens if index == chosen else 0
            child.update_state_after_alloc(request, blocks, tokens)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        """The tiers of the child serving the request's load, as that child reports them."""
        chosen = self._loading_child.get(request.request_id)
        if chosen is None:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return self._children[chosen].get_external_cache_hit_sources(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MultiKVConnectorMetadata:
        metadata = MultiKVConnectorMetadata(
            children=tuple(c.build_connector_meta(scheduler_output) for c in self._children),
            extra_async_saves=tuple(sorted(self._extra_async_saves.items())),
        )
        self._extra_async_saves = {}
        return metadata

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        # vLLM's KVConnectorOutput holds None when no worker reported events.
        self._worker_events.extend(connector_output.kv_cache_events or ())
        stats = connector_output.kv_connector_stats
        nested = stats.data if stats is not None else {}
        children_meta = per_child_worker_meta(
            type(self).__name__, connector_output.kv_connector_worker_meta, len(self._children)
        )
        for name, child, child_meta in zip(
            self._child_names, self._children, children_meta, strict=True
        ):
            # A child's counters: a mapping as get_kv_connector_stats nests them,
            # or a stats object where build_kv_connector_stats rebuilt them.
            child_stats = nested.get(name)
            if isinstance(child_stats, Mapping):
                child_stats = KVConnectorStats(data=dict(child_stats))
            elif not isinstance(child_stats, KVConnectorStats):
                child_stats = None
            child.update_connector_output(
                attrs.evolve(
                    connector_output,
                    kv_connector_stats=child_stats,
                    kv_cache_events=[],
                    kv_connector_worker_meta=child_meta,
                )
            )

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._loading_child.pop(request.request_id, None)
        answers = [child.request_finished(request, block_ids) for child in self._children]
        return self._merge_finished(request.request_id, answers)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._loading_child.pop(request.request_id, None)
        answers = []
        for child in self._children:
            if supports_hma(child):
                answers.append(child.request_finished_all_groups(request, block_ids))  # type: ignore[attr-defined]
            elif len(block_ids) == 1:
                # One KV cache group (HMA off): the plain call says the same.
                answers.append(child.request_finished(request, block_ids[0]))
            else:
                raise TypeError(
                    f"MultiConnector: child {type(child).__name__} does not support HMA, "
                    f"but the request has {len(block_ids)} KV cache groups"
                )
        return self._merge_finished(request.request_id, answers)

    def _merge_finished(
        self, request_id: str, answers: list[tuple[bool, dict[str, Any] | None]]
    ) -> tuple[bool, dict[str, Any] | None]:
        keeping, params = merge_finished_answers(answers)
        if keeping > 1:
            self._extra_async_saves[request_id] = keeping - 1
        return keeping > 0, params

    def register_finished_partial_tail(
        self,
        request: Request,
        block_ids: tuple[list[int], ...],
        partial_tail_offloads: list[tuple[int, int, int]],
    ) -> bool:
        accepted = [
            child.register_finished_partial_tail(request, block_ids, partial_tail_offloads)
            for child in self._children
        ]
        return any(accepted)

    def take_events(self) -> Iterable[KVCacheEvent]:
        events, self._worker_events = self._worker_events, []
        for child in self._children:
            events.extend(child.take_events())
        return events

    def has_pending_block_frees(self) -> bool:
        return any(child.has_pending_block_frees() for child in self._children)

    def has_pending_push_work(self) -> bool:
        return any(child.has_pending_push_work() for child in self._children)

    def get_finished_count(self) -> int | None:
        counts = [child.get_finished_count() for child in self._children]
        if any(count is None for count in counts):
            return None
        distinct = sorted({count for count in counts if count is not None})
        if len(distinct) > 1:
            raise ValueError(
                f"MultiConnector: children expect different numbers of finished reports "
                f"{distinct}; every child's get_finished_count() must agree"
            )
        return distinct[0] if distinct else None

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        for child in self._children:
            child.set_xfer_handshake_metadata(metadata)

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        for child in self._children:
            child.set_xfer_handshake_metadata_pp_aware(metadata)

    def reset_cache(self) -> bool | None:
        results = [child.reset_cache() for child in self._children]
        return all(result is not False for result in results)

    # ----------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for child in self._children:
            child.register_kv_caches(kv_caches)

    def get_mem_pool_context(self) -> contextlib.AbstractContextManager[Any] | None:
        """The one child's memory pool context: the KV cache lives in one pool only."""
        found = [
            (name, context)
            for name, child in zip(self._child_names, self._children, strict=True)
            if (context := child.get_mem_pool_context()) is not None
        ]
        if len(found) > 1:
            raise ValueError(
                f"MultiConnector: children {[name for name, _ in found]} each provide a KV cache "
                "memory pool; the KV cache is allocated once, in one pool: configure at most one"
            )
        return found[0][1] if found else None

    def set_host_xfer_buffer_ops(self, copy_operation: CopyBlocksOp) -> None:
        for child in self._children:
            child.set_host_xfer_buffer_ops(copy_operation)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        metadata = metadata_of_type(
            type(self).__name__, kv_connector_metadata, MultiKVConnectorMetadata
        )
        for child, child_metadata in zip(self._children, metadata.children, strict=True):
            child.handle_preemptions(child_metadata)

    def finish_forward(self) -> None:
        for child in self._children:
            child.finish_forward()

    def reset_capture_state(self) -> None:
        for child in self._children:
            child.reset_capture_state()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        metadata = metadata_of_type(
            type(self).__name__, connector_metadata, MultiKVConnectorMetadata
        )
        for child, child_metadata in zip(self._children, metadata.children, strict=True):
            child.bind_connector_metadata(child_metadata)
        self._finished_sending.expect(metadata.extra_async_saves)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        for child in self._children:
            child.clear_connector_metadata()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        for child in self._children:
            child.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        for child in self._children:
            child.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        for child in self._children:
            child.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        # One child loads a request, every child saves it: blocks computed
        # after a failed load (from stale cache contents) must reach none of them.
        self.skip_saves_computed_from(self.load_errors_this_step())
        for child in self._children:
            child.wait_for_save()

    def load_errors_this_step(self) -> set[int]:
        failed: set[int] = set()
        for child in self._children:
            failed |= child.load_errors_this_step()
        return failed

    def skip_saves_computed_from(self, block_ids: set[int]) -> None:
        for child in self._children:
            child.skip_saves_computed_from(block_ids)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return (results.finished_sending or None), (results.finished_recving or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = KVConnectorTransferResults()
        for child in self._children:
            child_results = child.get_transfer_results(finished_req_ids)
            results.finished_recving |= child_results.finished_recving
            results.failed_recving |= child_results.failed_recving
            for request_id in child_results.finished_sending:
                if self._finished_sending.is_last_report(request_id):
                    results.finished_sending.add(request_id)
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors: set[int] = set()
        for child in self._children:
            errors |= child.get_block_ids_with_load_errors()
        return errors

    def get_kv_connector_kv_cache_events(self) -> list[KVCacheEvent]:
        events: list[KVCacheEvent] = []
        for child in self._children:
            # None is vLLM's default for "no events" (a child written against its base).
            events.extend(child.get_kv_connector_kv_cache_events() or ())
        return events

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        nested = {}
        for name, child in zip(self._child_names, self._children, strict=True):
            stats = child.get_kv_connector_stats()
            if stats is not None and not stats.is_empty():
                nested[name] = stats.reduce()
        return KVConnectorStats(data=nested) if nested else None

    def wait_for_pending_saves(self, timeout_s: float | None = None) -> bool:
        """Every child's saves, within one ``timeout_s`` for them all."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        finished = True
        for child in self._children:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            finished = child.wait_for_pending_saves(remaining) and finished
        return finished

    def get_handshake_metadata(self) -> Any:
        return [child.get_handshake_metadata() for child in self._children]

    def build_connector_worker_meta(self) -> MultiKVConnectorWorkerMetadata | None:
        children = tuple(child.build_connector_worker_meta() for child in self._children)
        if all(child_meta is None for child_meta in children):
            return None
        return MultiKVConnectorWorkerMetadata(children)

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
