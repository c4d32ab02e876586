"""MultiConnector's scheduler half: which child loads a request, the workers' events, finishing.

Finishing: the children's answers for a finished request are merged, and the
extra sends to await go to the worker half in the next step's metadata.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from kvwire.connectors.multi._finishing import merge_finished_answers
from kvwire.connectors.multi._half import MultiHalf
from kvwire.connectors.multi.records import MultiKVConnectorMetadata, per_child_worker_meta
from kvwire.interface.base import KVConnectorBase, KVConnectorHandshakeMetadata, supports_hma
from kvwire.interface.types import (
    KVCacheBlocks,
    KVCacheEvent,
    KVConnectorOutput,
    KVConnectorStats,
    Request,
    SchedulerOutput,
)


class MultiSchedulerHalf(MultiHalf):
    """A MultiConnector's scheduler half: its state and calls (`owner`: in errors about workers)."""

    def __init__(
        self, owner: str, children: Sequence[KVConnectorBase], child_names: Sequence[str]
    ) -> None:
        super().__init__(owner, children, child_names)
        # The index of the child serving a request's load, by request id:
        # chosen at lookup, kept until the request finishes.
        self._loading_child: dict[str, int] = {}
        self._extra_async_saves: dict[str, int] = {}
        self._worker_events: list[KVCacheEvent] = []

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        for child in self._children:
            child.bind_kv_cache_manager(kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        for child in self._children:
            child.bind_gpu_block_pool(gpu_block_pool)

    def on_new_request(self, request: Request) -> None:
        for child in self._children:
            child.on_new_request(request)

    def loading_child(self, request_id: str) -> KVConnectorBase | None:
        """The child serving `request_id`'s load, or None when no child had a hit for it."""
        chosen = self._loading_child.get(request_id)
        return None if chosen is None else self._children[chosen]

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
            self._owner, connector_output.kv_connector_worker_meta, len(self._children)
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
