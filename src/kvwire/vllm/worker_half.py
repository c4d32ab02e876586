"""KVWireConnector's worker half: vLLM's worker calls, translated for the wrapped connector.

A worker-role `KVWireConnector` builds one `KVWireWorkerHalf` around the kvwire
connector of that role and passes it each call it translates: the caches
registered with the wrapped connector's I/O threads started off the model's
pinned cores (`kvwire.vllm.cores`), the step's metadata unwrapped, the forward
context as kvwire's, events as vLLM carries them, and on a hybrid cache a
failed asynchronous load reported as its request (see `kvwire.vllm.connector`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorTransferResults,
)

from kvwire.interface.base import KVConnectorBase
from kvwire.interface.types import ForwardContext
from kvwire.vllm.cores import threads_started_on_engine_cores
from kvwire.vllm.events import KVWireKVEvents
from kvwire.vllm.metadata import KVWireConnectorMetadata, inner_metadata

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class KVWireWorkerHalf:
    """The state of one vLLM worker's side, around `connector`, the wrapped worker-role one.

    `layer_names` are the layers of kvwire's KV cache config, `hybrid`
    whether vLLM's KV cache has several groups (or a sliding-window one).
    """

    def __init__(
        self, connector: KVConnectorBase, *, layer_names: Iterable[str], hybrid: bool
    ) -> None:
        self._connector = connector
        self._hybrid = hybrid
        self._forward_context = ForwardContext(layer_names=tuple(layer_names))
        self._async_loading: dict[str, frozenset[int]] = {}
        self._load_errors: set[int] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # The wrapped connector starts its I/O threads here.
        with threads_started_on_engine_cores():
            self._connector.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._connector.handle_preemptions(inner_metadata(kv_connector_metadata))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self._connector.bind_connector_metadata(inner_metadata(connector_metadata))
        assert isinstance(connector_metadata, KVWireConnectorMetadata)  # checked by inner_metadata
        self._async_loading.update(connector_metadata.async_loads)

    def clear_connector_metadata(self) -> None:
        self._connector.clear_connector_metadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._connector.start_load_kv(self._forward_context, **kwargs)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        finished_sending, finished_recving = self._connector.get_finished(finished_req_ids)
        results = KVConnectorTransferResults(
            finished_sending=set(finished_sending or ()),
            finished_recving=set(finished_recving or ()),
        )
        if self._hybrid:
            # Asked here, before vLLM asks get_block_ids_with_load_errors, so
            # that a failed asynchronous load is reported as its request.
            self._load_errors |= self._connector.get_block_ids_with_load_errors()
            for request_id in results.finished_recving:
                blocks = self._async_loading.pop(request_id, frozenset())
                if blocks & self._load_errors:
                    results.failed_recving.add(request_id)
                    self._load_errors -= blocks
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        if not self._hybrid:
            return self._connector.get_block_ids_with_load_errors()
        # Errors of asynchronous loads still running wait for their request's report.
        loading = frozenset().union(*self._async_loading.values())
        errors = self._load_errors - loading
        self._load_errors &= loading
        if errors:
            logger.error(
                "KVWireConnector: %d blocks failed to load synchronously on a hybrid model; "
                "vLLM cannot recompute them there and stops. Set async_load: true in the "
                "wrapped connector's kv_connector_extra_config: a failed asynchronous load is "
                "recomputed (kv_load_failure_policy)",
                len(errors),
            )
        return errors

    def get_kv_connector_kv_cache_events(self) -> KVWireKVEvents | None:
        events = self._connector.get_kv_connector_kv_cache_events()
        return KVWireKVEvents(events) if events else None
