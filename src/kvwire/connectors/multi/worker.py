"""MultiConnector's worker half: every worker call to every child, and the finished sends held back.

A request's finished-sending report is held back until every child keeping its blocks
sent one (`FinishedSendingTally`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kvwire.connectors.multi._finishing import FinishedSendingTally
from kvwire.connectors.multi._half import MultiHalf
from kvwire.connectors.multi.records import (
    MultiKVConnectorMetadata,
    MultiKVConnectorWorkerMetadata,
)
from kvwire.interface.base import (
    CopyBlocksOp,
    KVConnectorBase,
    KVConnectorMetadata,
    metadata_of_type,
)
from kvwire.interface.types import ForwardContext, KVCacheEvent, KVConnectorTransferResults

if TYPE_CHECKING:
    import torch


class MultiWorkerHalf(MultiHalf):
    """A MultiConnector's worker half: its state and calls (`owner`: in errors on its metadata)."""

    def __init__(
        self, owner: str, children: Sequence[KVConnectorBase], child_names: Sequence[str]
    ) -> None:
        super().__init__(owner, children, child_names)
        self._finished_sending = FinishedSendingTally()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for child in self._children:
            child.register_kv_caches(kv_caches)

    def register_cross_layers_kv_cache(self, kv_cache: torch.Tensor, attn_backend: Any) -> None:
        # Given only when every child prefers it (prefer_cross_layer_blocks).
        for child in self._children:
            child.register_cross_layers_kv_cache(kv_cache, attn_backend)

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
        metadata = metadata_of_type(self._owner, kv_connector_metadata, MultiKVConnectorMetadata)
        for child, child_metadata in zip(self._children, metadata.children, strict=True):
            child.handle_preemptions(child_metadata)

    def finish_forward(self) -> None:
        for child in self._children:
            child.finish_forward()

    def reset_capture_state(self) -> None:
        for child in self._children:
            child.reset_capture_state()

    def expect_finished_sending(self, extra_async_saves: Iterable[tuple[str, int]]) -> None:
        """A step's `extra_async_saves`: the reports to hold back before a request is sent."""
        self._finished_sending.expect(extra_async_saves)

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

    def wait_for_pending_saves(self, timeout_s: float | None = None) -> bool:
        """Every child's saves, within one `timeout_s` for them all."""
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
