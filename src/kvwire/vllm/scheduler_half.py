"""KVWireConnector's scheduler half: vLLM's scheduler calls, translated for the wrapped connector.

A scheduler-role `KVWireConnector` builds one `KVWireSchedulerHalf` around the
kvwire connector of that role and passes it each call it translates: vLLM's
requests as live views, its block-id deltas as full block lists, its double
`update_state_after_alloc` for asynchronous loads (`kvwire.vllm.scheduler_bridge`);
finished requests' blocks held while a save reads them; events as vLLM's
`BlockStored` / `BlockRemoved` (`kvwire.vllm.events`); on a hybrid cache, each
asynchronous load's blocks sent to the workers and, when the load is reported
failed, told to the wrapped connector (see `kvwire.vllm.connector`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvwire.blocks.groups import NULL_BLOCK_ID
from kvwire.identity.adapter_keys import AdapterKeys
from kvwire.interface.base import KVConnectorBase
from kvwire.interface.base import SupportsHMA as KVWireSupportsHMA
from kvwire.interface.types import KVCacheBlocks, KVConnectorOutput
from kvwire.ranks import EveryRank
from kvwire.vllm.events import BlockTokens
from kvwire.vllm.metadata import KVWireConnectorMetadata
from kvwire.vllm.scheduler_bridge import AllocationFilter, BlockTables, RequestViews


class KVWireSchedulerHalf:
    """The state of vLLM's scheduler side, around `connector`, the wrapped scheduler-role one.

    `adapter_keys` identifies requests' LoRA adapters, `block_size` is
    vLLM's, `world_size` the ranks that each report a block stored, `hybrid`
    whether vLLM's KV cache has several groups (or a sliding-window one).
    """

    def __init__(
        self,
        connector: KVConnectorBase,
        *,
        adapter_keys: AdapterKeys,
        block_size: int,
        world_size: int,
        hybrid: bool,
    ) -> None:
        self._connector = connector
        self._hybrid = hybrid
        self._views = RequestViews(adapter_keys)
        self._block_tables = BlockTables()
        self._allocations = AllocationFilter()
        self._block_tokens = BlockTokens(block_size)
        self._every_rank = EveryRank(world_size)
        self._kv_cache_manager: Any = None
        self._live: dict[str, tuple[Any, int]] = {}
        self._kept_blocks: set[str] = set()
        self._step_async_loads: dict[str, frozenset[int]] = {}
        # Asynchronous loads sent to the workers and not yet reported, by request.
        self._async_loads_sent: dict[str, frozenset[int]] = {}

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        """vLLM's own manager: a hybrid request's live block ids are read from it."""
        self._kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        view = self._views.view(request)
        if not view.shares:
            # An adapter kvwire cannot identify: nothing is looked up for it.
            self._allocations.looked_up(request.request_id, False)
            return 0, False
        tokens, load_async = self._connector.get_num_new_matched_tokens(
            view.as_request(), num_computed_tokens
        )
        self._allocations.looked_up(request.request_id, load_async)
        return tokens, load_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._live.setdefault(request.request_id, (request, 0))
        if not self._allocations.should_forward(request.request_id, num_external_tokens):
            return
        block_ids = tuple(list(ids) for ids in blocks.get_block_ids())
        if self._hybrid and self._allocations.loading_async(request.request_id):
            self._step_async_loads[request.request_id] = frozenset(
                block for group in block_ids for block in group if block != NULL_BLOCK_ID
            )
        self._connector.update_state_after_alloc(
            self._views.view(request).as_request(),
            KVCacheBlocks(block_ids=block_ids),
            num_external_tokens,
        )

    def build_connector_meta(self, scheduler_output: Any) -> KVWireConnectorMetadata:
        manager = self._kv_cache_manager
        live = manager.get_block_ids if self._hybrid and manager is not None else None
        kvwire_output = self._block_tables.to_kvwire(scheduler_output, live)
        for item in kvwire_output.scheduled:
            self._remember_blocks(item.request_id)
        inner = self._connector.build_connector_meta(kvwire_output)
        async_loads, self._step_async_loads = self._step_async_loads, {}
        self._async_loads_sent.update(async_loads)
        return KVWireConnectorMetadata(inner=inner, async_loads=async_loads)

    def _remember_blocks(self, request_id: str) -> None:
        live = self._live.get(request_id)
        if live is None:
            return
        request, remembered = live
        # The keys the wrapped connector stores the blocks under (folded with a LoRA adapter's).
        keys = self._views.view(request).block_hashes
        if len(keys) > remembered:
            adapter = getattr(request, "lora_request", None)
            self._block_tokens.remember(
                request.block_hashes,
                request.all_token_ids,
                remembered,
                keys=keys,
                lora_id=adapter.lora_int_id if adapter else None,
                lora_name=adapter.lora_name if adapter else None,
            )
            self._live[request_id] = (request, len(keys))

    def update_connector_output(self, connector_output: Any) -> None:
        events = connector_output.kv_cache_events
        finished_sending = set(connector_output.finished_sending or ())
        finished_recving = set(connector_output.finished_recving or ())
        # vLLM frees a finished request's blocks at its first report, recving
        # (a request aborted while loading) or sending, and then knows the
        # request no more: a later report of it fails vLLM's assertion. So
        # vLLM sees a request as sent only while it keeps blocks for us; the
        # wrapped connector sees every report.
        self._kept_blocks -= finished_recving
        connector_output.finished_sending = (finished_sending & self._kept_blocks) or None
        self._kept_blocks -= finished_sending
        invalid_block_ids = set(connector_output.invalid_block_ids or ())
        failed_recving = getattr(connector_output, "failed_recving", None) or set()
        for request_id in finished_recving | failed_recving:
            blocks = self._async_loads_sent.pop(request_id, frozenset())
            if request_id in failed_recving:
                # Reported as a failed request (see kvwire.vllm.connector): its blocks failed.
                invalid_block_ids |= blocks
        self._connector.update_connector_output(
            KVConnectorOutput(
                finished_sending=finished_sending or None,
                finished_recving=finished_recving or None,
                invalid_block_ids=invalid_block_ids,
                kv_cache_events=(
                    self._every_rank.whole(events.get_all_events()) if events is not None else []
                ),
                kv_connector_worker_meta=connector_output.kv_connector_worker_meta,
            )
        )

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # vLLM calls request_finished_all_groups on a SupportsHMA connector;
        # a caller of the one-group call gets the same answer.
        return self.request_finished_all_groups(request, (list(block_ids),))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        request_id = request.request_id
        self._allocations.forget(request_id)
        self._live.pop(request_id, None)
        view = self._views.view(request).as_request()
        self._views.forget(request_id)
        group_ids = tuple(list(ids) for ids in block_ids)
        wrapped = self._connector
        if isinstance(wrapped, KVWireSupportsHMA):
            keep, params = wrapped.request_finished_all_groups(view, group_ids)
        else:
            # Only a cache of one full-attention group is served without HMA
            # (checked when built), so this is that group's list.
            (only_group,) = group_ids
            keep, params = wrapped.request_finished(view, only_group)
        if keep:
            self._kept_blocks.add(request_id)
        return keep, params

    def has_pending_push_work(self) -> bool:
        # Finished requests whose blocks a save still reads: the engine keeps
        # stepping until the worker reports them, then frees their blocks.
        return bool(self._kept_blocks)

    def take_events(self) -> Iterable[Any]:
        return self._block_tokens.to_vllm(self._connector.take_events())
