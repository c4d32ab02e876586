"""The kit's load failures on purpose: any connector, wrapped, has chosen loads fail.

A connector under test may keep its blocks anywhere (a medium or not), so
the kit fails its loads from outside: `kvwire.testing.with_load_faults`
overrides a container's `connector_class` with a `LoadFaultConnector` around the class the config
names. In each role it builds the wrapped connector through the registry (as a composite builds its
children) and delegates every call to it, except that:

- its scheduler half learns the blocks each load fills from
  `update_state_after_alloc` and picks, for each chosen request's first load,
  the block at `fail_block_index` of the loaded range (every KV cache group's
  blocks, group after group, null blocks left out), which it sends to the
  worker half inside the step's metadata (`LoadFaultMetadata`, the wrapped
  connector's metadata within);
- its worker half leaves garbage (0xFF bytes: NaN in every float dtype) in
  that block after the wrapped connector loaded it, and reports the block
  as a load error: a synchronous load's in that step, layer by layer once
  `wait_for_layer_load` returned, telling the wrapped connector
  (`skip_saves_computed_from`) before it saves the step; an asynchronous
  load's once it is reported finished.

The wrapper lives in the container it is applied to: the engine's, for the
worker inline. A worker process builds its connector from its own
container: hand the engine a `kvwire.testing.LoadFaultsHook` as its
`worker_container_hook` (each rank of a parallel engine applies it to its
container), and `ranks` limits the garbage and the reports to those ranks.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, ClassVar

import attrs
from dependency_injector import providers

from kvwire.blocks.format import BlockLayout
from kvwire.blocks.groups import NULL_BLOCK_ID, cache_groups
from kvwire.container import KVConnectorContainer
from kvwire.interface.base import ConnectorBuilder, KVConnectorMetadata, KVConnectorRole
from kvwire.interface.forwarding import ForwardingConnector
from kvwire.interface.types import (
    KVCacheBlocks,
    KVConnectorTransferResults,
    Request,
    SchedulerOutput,
)
from kvwire.testing.faulty_medium import LoadFaults, poison_block

if TYPE_CHECKING:
    import torch

    from kvwire.blocks.memory import BlockMemory
    from kvwire.config import EngineConfig
    from kvwire.config.kv_cache import KVCacheConfig

__all__ = [
    "LoadFault",
    "LoadFaultConnector",
    "LoadFaultMetadata",
    "LoadFaultsHook",
    "with_load_faults",
]


@attrs.frozen
class LoadFault:
    """A block of a load to fail: its request, KV cache group and id; whether the load is async."""

    request_id: str
    group: int
    block_id: int
    is_async: bool


@attrs.frozen
class LoadFaultMetadata(KVConnectorMetadata):
    """The wrapped connector's step metadata, and the loads of the step to fail."""

    inner: KVConnectorMetadata
    faults: tuple[LoadFault, ...] = ()


class LoadFaultConnector(ForwardingConnector):
    """`wrapped`, whose chosen loads fail; build it through
    `kvwire.testing.with_load_faults`.

    `wrapped` is the class of the connector under test (what the config
    names); every call its faults do not concern reaches it unchanged
    (`kvwire.ForwardingConnector`).
    """

    fail_request_ids: ClassVar[frozenset[str] | None] = None
    """The requests whose first load fails; None: every request's."""
    fail_block_index: ClassVar[int] = 0
    """Which block of the loaded range fails (negative: from the end)."""
    fail_ranks: ClassVar[frozenset[int] | None] = None
    """The ranks whose worker half fails the loads (`parallel_config.rank`); None: every rank."""

    def __init__(
        self,
        vllm_config: EngineConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
        *,
        connector_builder: ConnectorBuilder,
    ) -> None:
        super().__init__(
            vllm_config,
            role,
            kv_cache_config,
            inner=connector_builder(vllm_config, role, kv_cache_config),
        )
        self._groups = cache_groups(kv_cache_config)
        # A hybrid engine's null block holds positions that left a window: never loaded.
        self._null_block = (
            NULL_BLOCK_ID if any(g.sliding_window is not None for g in self._groups) else None
        )
        # Scheduler half.
        self._faults = LoadFaults(self.fail_request_ids, self.fail_block_index)
        self._lookups: dict[str, tuple[int, bool]] = {}
        self._planned: list[LoadFault] = []
        # Worker half.
        self._layer_memories: dict[str, BlockMemory] = {}
        self._step_faults: tuple[LoadFault, ...] = ()
        self._async_faults: dict[str, LoadFault] = {}
        self._unreported: set[int] = set()
        self._fails_here = self.fail_ranks is None or (
            vllm_config.parallel_config.rank in self.fail_ranks
        )

    # ------------------------------------------------------------ worker half

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # Imported here: it needs torch, which the scheduler half never imports.
        from kvwire.blocks.memory import BlockMemory

        super().register_kv_caches(kv_caches)
        # One layer at a time: a synchronous load is known loaded layer by layer.
        layer = attrs.evolve(BlockLayout.from_engine_config(self._vllm_config), num_layers=1)
        self._layer_memories = {
            name: BlockMemory({name: kv_caches[name]}, layer)
            for group in self._groups
            for name in group.layer_names
        }

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        metadata = self._unwrap(connector_metadata)
        if not self._fails_here:
            return
        self._step_faults = tuple(fault for fault in metadata.faults if not fault.is_async)
        self._unreported |= {fault.block_id for fault in self._step_faults}
        self._async_faults.update(
            (fault.request_id, fault) for fault in metadata.faults if fault.is_async
        )

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._step_faults = ()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.inner.wait_for_layer_load(layer_name)
        # Only now: the wrapped load of this layer, still running before, would overwrite it.
        for fault in self._step_faults:
            if layer_name in self._groups[fault.group].layer_names:
                poison_block(self._layer_memories[layer_name], fault.block_id)

    def wait_for_save(self) -> None:
        if self._step_faults:
            # As a connector whose own load failed: nothing computed from the
            # garbage may be saved (it would be stored under valid hashes).
            self.inner.skip_saves_computed_from({fault.block_id for fault in self._step_faults})
        self.inner.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, receiving = self.inner.get_finished(finished_req_ids)
        self._received(receiving or ())
        return sending, receiving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = self.inner.get_transfer_results(finished_req_ids)
        self._received(results.finished_recving)
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        unreported, self._unreported = self._unreported, set()
        return set(self.inner.get_block_ids_with_load_errors()) | unreported

    def load_errors_this_step(self) -> set[int]:
        return self.inner.load_errors_this_step() | {fault.block_id for fault in self._step_faults}

    # --------------------------------------------------------- scheduler half

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        num_external, is_async = self.inner.get_num_new_matched_tokens(request, num_computed_tokens)
        if num_external is not None:
            # Where the load starts: update_state_after_alloc is not told.
            self._lookups[request.request_id] = (num_computed_tokens, is_async)
        return num_external, is_async

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.inner.update_state_after_alloc(request, blocks, num_external_tokens)
        lookup = self._lookups.pop(request.request_id, None)
        if num_external_tokens <= 0 or lookup is None:
            return
        num_local, is_async = lookup
        block_size = self._groups[0].block_size
        first = num_local // block_size
        last = -(-(num_local + num_external_tokens) // block_size)
        loaded = [
            (group, block_id)
            for group, group_blocks in enumerate(blocks.get_block_ids())
            for block_id in group_blocks[first:last]
            if block_id != self._null_block
        ]
        chosen = self._faults.choose(request.request_id, loaded)
        if chosen is not None:
            self._planned.append(LoadFault(request.request_id, *chosen, is_async))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> LoadFaultMetadata:
        planned, self._planned = tuple(self._planned), []
        return LoadFaultMetadata(self.inner.build_connector_meta(scheduler_output), planned)

    # -------------------------------------------------------------- internals

    def _inner_metadata(self, metadata: KVConnectorMetadata) -> KVConnectorMetadata:
        return self._unwrap(metadata).inner

    def _unwrap(self, metadata: KVConnectorMetadata) -> LoadFaultMetadata:
        if not isinstance(metadata, LoadFaultMetadata):
            raise TypeError(
                f"{type(self).__name__}: expected the step metadata its scheduler half builds "
                f"(LoadFaultMetadata), got {type(metadata).__name__}"
            )
        return metadata

    def _received(self, request_ids: Iterable[str]) -> None:
        """Fail the chosen asynchronous loads among those just reported finished."""
        for request_id in request_ids:
            fault = self._async_faults.pop(request_id, None)
            if fault is None:
                continue
            for name in self._groups[fault.group].layer_names:
                poison_block(self._layer_memories[name], fault.block_id)
            self._unreported.add(fault.block_id)


def with_load_faults(
    container: KVConnectorContainer,
    *,
    block_index: int = 0,
    request_ids: frozenset[str] | None = None,
    ranks: frozenset[int] | None = None,
) -> KVConnectorContainer:
    """`container`, its `connector_class` overridden by a `LoadFaultConnector` around it.

    Each request in `request_ids` (every request when None) has its first
    load fail at the block at `block_index` of the loaded range, on the
    workers of `ranks` (None: all). Hand the container to the engine
    (`LLMEngine(config, container=...)`); worker processes need a
    `kvwire.testing.LoadFaultsHook` too.
    """
    wrapped_class = container.connector_class()

    class Faulty(LoadFaultConnector):
        wrapped = wrapped_class
        fail_request_ids = request_ids
        fail_block_index = block_index
        fail_ranks = ranks

    Faulty.__name__ = Faulty.__qualname__ = f"LoadFaults({wrapped_class.__name__})"
    container.connector_class.override(providers.Object(Faulty))
    return container


@attrs.frozen
class LoadFaultsHook:
    """`kvwire.testing.with_load_faults` as a picklable container hook, for the
    engine's worker processes.

    `LLMEngine(config, container=with_load_faults(..., ranks=r),
    worker_container_hook=LoadFaultsHook(ranks=r))`: the scheduler half
    picks the faults, the workers of `ranks` leave garbage and report them.
    """

    block_index: int = 0
    request_ids: frozenset[str] | None = None
    ranks: frozenset[int] | None = None

    def __call__(self, container: KVConnectorContainer) -> None:
        with_load_faults(
            container,
            block_index=self.block_index,
            request_ids=self.request_ids,
            ranks=self.ranks,
        )
