"""The CPU-offload connector, kvwire's default: KV blocks kept in a CPU memory pool.

The scheduler side owns the pool's index (an LRU keyed by KV cache group and
block hash, see :mod:`kvwire.media.cpu_pool._index`) and decides every
slot; the worker
side owns the pool memory (:mod:`kvwire.media.cpu_pool._handler`) and
copies. Stores complete asynchronously: a finished request whose stores are
still running keeps its blocks (``request_finished`` returns True) until the
worker reports it finished sending, and only then do its blocks become
visible to lookups.

A hybrid model's groups share the pool: each group's blocks are entries of
their own (a sliding-window group stores only the blocks its window still
reaches, see :class:`~kvwire.connectors.offload._planner.BlockPlanner`), and a
finished request keeps its blocks in every group until its stores in every
group are done. Events name each group's blocks separately: with several
groups, one block hash may be stored (or removed) once per group.

A block a store still reads may be freed before the store ends (a sliding
window moved on, a request was preempted) and given to a request that
writes it in the next step. Each step's metadata names the block ids given
to requests since the last one (``new_block_ids``); before anything of the
step writes, the worker releases every store in flight that reads one of
them, and reports it (:class:`CPUOffloadWorkerMetadata`): the scheduler side
frees its slots, never publishing them (``saves_released`` counts the blocks).
It reports the same way the stores it left out because a load they were
computed from failed (``saves_skipped_after_failed_load``): the scheduler
side frees exactly the slots the worker names, never guessing which.

``kv_connector_extra_config`` keys:

- ``cpu_pool_bytes`` (default ``"256MiB"``): pool size; one slot holds one
  block of every layer of a KV cache group plus a 128-byte header;
- ``io_threads`` (default 2): copy threads per direction;
- ``async_load`` (default false): loads reported through ``get_finished``;
- ``transfer_timeout_s`` (default 30): the deadline of each copy; a load
  still running then is a load error (computed again), a store still
  running then counts failed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from kvwire.blocks.transfers import BlockTransfer
from kvwire.connector.base import KVConnectorMetadata, KVConnectorRole, KVConnectorWorkerMetadata
from kvwire.connector.types import (
    BlockHash,
    BlockRemoved,
    BlockStored,
    ForwardContext,
    KVCacheBlocks,
    KVCacheEvent,
    KVConnectorOutput,
    KVConnectorStats,
    Request,
    SchedulerOutput,
)
from kvwire.connector.worker_steps import metadata_of_type
from kvwire.connectors.offload._block_connector import BlockConnector
from kvwire.extra_config import (
    ExtraConfigError,
    ExtraConfigKey,
    bool_key,
    int_key,
    memory_size_key,
    seconds_key,
)
from kvwire.media.cpu_pool._handler import CPUPoolWorker
from kvwire.media.cpu_pool._index import CPUPoolIndex

if TYPE_CHECKING:
    import torch

    from kvwire.config import EngineConfig
    from kvwire.kv_cache_config import KVCacheConfig

logger = logging.getLogger(__name__)

MEDIUM = "cpu"


@attrs.frozen
class CPUOffloadMetadata(KVConnectorMetadata):
    """One step's plan for the worker side.

    ``preempted_req_ids``: requests whose blocks were freed; their running
    stores must end before the forward pass reuses the blocks.
    ``release_req_ids``: finished requests that keep their blocks until their
    transfers end; the worker reports them as finished sending then.
    ``counters``: the scheduler side's counts, reported by the worker.
    ``new_block_ids``: block ids given to requests since the last step, to be
    written from this step on; stores still reading one are released.
    """

    loads: tuple[BlockTransfer, ...] = ()
    async_loads: tuple[BlockTransfer, ...] = ()
    stores: tuple[BlockTransfer, ...] = ()
    preempted_req_ids: tuple[str, ...] = ()
    release_req_ids: tuple[str, ...] = ()
    counters: tuple[tuple[str, int], ...] = ()
    new_block_ids: frozenset[int] = frozenset()


@attrs.frozen
class CPUOffloadWorkerMetadata(KVConnectorWorkerMetadata):
    """One step's report to the scheduler side: the planned stores (pieces) the worker did not make.

    ``released_stores``: stopped because a block they read was given to
    another request; their slots may hold that request's bytes.
    ``left_out_stores``: never started because they were computed from a
    block whose load failed; their slots hold nothing of theirs.
    Either way the slots must never be published.
    """

    released_stores: tuple[BlockTransfer, ...] = ()
    left_out_stores: tuple[BlockTransfer, ...] = ()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> CPUOffloadWorkerMetadata:
        # Tensor-parallel workers each report what they released or left out.
        theirs = _of_type(other)
        return CPUOffloadWorkerMetadata(
            self.released_stores + theirs.released_stores,
            self.left_out_stores + theirs.left_out_stores,
        )


def _of_type(worker_meta: object) -> CPUOffloadWorkerMetadata:
    if not isinstance(worker_meta, CPUOffloadWorkerMetadata):
        raise TypeError(
            f"CPUOffloadConnector got worker metadata of type {type(worker_meta).__name__}, "
            "expected CPUOffloadWorkerMetadata"
        )
    return worker_meta


@attrs.define
class _PoolRequestState:
    """A request's transfers the pool index has not settled yet.

    ``unconfirmed_stores`` has one list per KV cache group; ``async_loads``
    one transfer per group that loads.
    """

    unconfirmed_stores: tuple[list[BlockHash], ...]
    async_loads: list[BlockTransfer] = attrs.field(factory=list)

    @property
    def stores_running(self) -> bool:
        return any(self.unconfirmed_stores)


class CPUOffloadConnector(BlockConnector[CPUPoolWorker]):
    """Offloads full KV blocks to a preallocated CPU pool and loads them back."""

    def __init__(
        self, config: EngineConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        self.num_slots = self._options["cpu_pool_bytes"] // self._layout.entry_bytes
        if self.num_slots < 1:
            raise ExtraConfigError(
                f"kv_connector_extra_config.cpu_pool_bytes: {self._options['cpu_pool_bytes']} "
                f"bytes hold no block; expected at least {self._layout.entry_bytes} (one block "
                "of every layer plus its header)"
            )
        # Scheduler side.
        self._index = CPUPoolIndex(self.num_slots, len(self._groups))
        self._requests: dict[str, _PoolRequestState] = {}
        self._finished: dict[str, _PoolRequestState] = {}
        self._step_loads: list[BlockTransfer] = []
        self._step_async_loads: list[BlockTransfer] = []
        self._sync_loads_in_flight: list[BlockTransfer] = []
        self._release_req_ids: list[str] = []
        self._step_counters: dict[str, int] = {}
        self._events: list[KVCacheEvent] = []
        # Worker side: stores released, and stores left out, since the last report.
        self._released_stores: list[BlockTransfer] = []
        self._left_out_stores: list[BlockTransfer] = []

    @classmethod
    def extra_config_keys(cls) -> tuple[ExtraConfigKey, ...]:
        """The ``kv_connector_extra_config`` keys: see the module docstring."""
        return (
            memory_size_key("cpu_pool_bytes", 256 * 1024**2),
            int_key("io_threads", 2, minimum=1, maximum=64),
            bool_key("async_load", False),
            seconds_key("transfer_timeout_s", 30.0, maximum=24 * 3600),
        )

    def count_held_prefix(self, group: int, block_hashes: Sequence[BlockHash]) -> int:
        """Blocks being stored count only once their store is confirmed."""
        return self._index.count_ready_prefix(group, block_hashes)

    def transfers_running(self, request_id: str) -> bool:
        """A finished request's blocks stay kept while its stores (or a load) run."""
        return self._worker is not None and self._worker.is_busy(request_id)

    def _count(self, name: str, amount: int) -> None:
        if amount:
            self._step_counters[name] = self._step_counters.get(name, 0) + amount

    # -------------------------------------------------------- scheduler side

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        previous = self._requests.get(request.request_id)
        # Resumed after preemption: its stores still count.
        state = _PoolRequestState(
            previous.unconfirmed_stores if previous is not None else tuple([] for _ in self._groups)
        )
        self._requests[request.request_id] = state
        loads = self._planner.allocate(request, blocks, num_external_tokens)
        for load in loads:
            ready = self._index.count_ready_prefix(load.group, load.block_hashes)
            if ready < len(load.block_hashes):
                raise ValueError(
                    f"update_state_after_alloc: request {request.request_id!r} asks for "
                    f"{num_external_tokens} external tokens; the CPU pool holds {ready} of the "
                    f"{len(load.block_hashes)} blocks they need in KV cache group {load.group}"
                )
        # Pinned only once every group's blocks are known to be there.
        for load in loads:
            transfer = attrs.evolve(
                load, slots=tuple(self._index.start_load(load.group, load.block_hashes))
            )
            if self._async_load:
                state.async_loads.append(transfer)
                self._step_async_loads.append(transfer)
            else:
                self._step_loads.append(transfer)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> CPUOffloadMetadata:
        stores: list[BlockTransfer] = []
        for save in self._planner.plan_saves(scheduler_output):
            transfer = self._place_store(save)
            if transfer is not None:
                stores.append(transfer)
        new_block_ids = frozenset(self._planner.take_new_block_ids())
        hit_blocks, miss_blocks = self._planner.take_lookup_counts()
        self._count("lookup_hit_blocks", hit_blocks)
        self._count("lookup_miss_blocks", miss_blocks)
        self._count("evicted_blocks", self._record_evictions())
        metadata = CPUOffloadMetadata(
            loads=tuple(self._step_loads),
            async_loads=tuple(self._step_async_loads),
            stores=tuple(stores),
            preempted_req_ids=tuple(sorted(scheduler_output.preempted_req_ids)),
            release_req_ids=tuple(self._release_req_ids),
            counters=tuple(sorted(self._step_counters.items())),
            new_block_ids=new_block_ids,
        )
        self._sync_loads_in_flight.extend(self._step_loads)
        self._step_loads = []
        self._step_async_loads = []
        self._release_req_ids = []
        self._step_counters = {}
        return metadata

    def _place_store(self, save: BlockTransfer) -> BlockTransfer | None:
        """Slots for the blocks of ``save`` the pool lacks; blocks it holds are not copied again."""
        wanted = save.block_hashes
        group = save.group
        placed = dict(self._index.prepare_store(group, wanted))
        # Blocks neither placed nor already in the pool found every slot pinned.
        skipped = sum(1 for h in wanted if h not in placed and not self._index.holds(group, h))
        self._count("stores_skipped_pool_full", skipped)
        if not placed:
            return None
        positions = [i for i, block_hash in enumerate(wanted) if block_hash in placed]
        self._requests[save.request_id].unconfirmed_stores[group].extend(placed)
        return attrs.evolve(
            save,
            block_ids=tuple(save.block_ids[i] for i in positions),
            block_hashes=tuple(wanted[i] for i in positions),
            slots=tuple(placed[wanted[i]] for i in positions),
        )

    def _record_evictions(self) -> int:
        count = 0
        for evicted in self._index.take_evicted():
            if evicted:
                self._events.append(BlockRemoved(block_hashes=tuple(evicted), medium=MEDIUM))
                count += len(evicted)
        return count

    def _keeps_blocks_when_finished(self, request: Request) -> bool:
        """Keep the request's blocks, in every group, while its stores (or a load) run."""
        self._planner.forget(request.request_id)
        state = self._requests.pop(request.request_id, None)
        if state is None or not (state.stores_running or state.async_loads):
            return False
        # Its stores (or a load) may still read or write its blocks: keep them
        # until the worker reports the request finished sending.
        self._finished[request.request_id] = state
        self._release_req_ids.append(request.request_id)
        return True

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        invalid = connector_output.invalid_block_ids
        self._planner.loads_failed(invalid)
        # Before finished_sending below: a request's stores released (or left
        # out) in the step that reports it finished must not be confirmed
        # with the rest.
        worker_meta = connector_output.kv_connector_worker_meta
        if worker_meta is not None:
            report = _of_type(worker_meta)
            for store in (*report.left_out_stores, *report.released_stores):
                self._drop_store(store)
        # Synchronous loads end within their step: their slots are free to evict again.
        for transfer in self._sync_loads_in_flight:
            self._end_load(transfer, invalid)
        self._sync_loads_in_flight = []
        for request_id in connector_output.finished_recving or ():
            state = self._requests.get(request_id) or self._finished.get(request_id)
            if state is not None:
                for load in state.async_loads:
                    self._end_load(load, invalid)
                state.async_loads = []
        for request_id in connector_output.finished_sending or ():
            state = self._finished.pop(request_id, None)
            if state is None:
                continue
            for load in state.async_loads:
                self._end_load(load, invalid)
            for group, hashes in enumerate(state.unconfirmed_stores):
                completed = self._index.complete_store(group, hashes)
                if completed:
                    self._events.append(BlockStored(block_hashes=tuple(completed), medium=MEDIUM))

    def _drop_store(self, store: BlockTransfer) -> None:
        """Free the slots of a store whose entries must never become hits (left out or released).

        Its blocks are no longer its request's to confirm: a request kept
        only for them is released when the worker reports it finished sending.
        """
        self._index.abandon_store(store.group, store.block_hashes)
        state = self._requests.get(store.request_id) or self._finished.get(store.request_id)
        if state is not None:
            dropped = set(store.block_hashes)
            unconfirmed = state.unconfirmed_stores[store.group]
            unconfirmed[:] = [h for h in unconfirmed if h not in dropped]

    def _end_load(self, transfer: BlockTransfer, invalid_block_ids: set[int]) -> None:
        self._index.finish_load(transfer.group, transfer.block_hashes)
        # A slot that failed verification would fail every later load: forget it.
        corrupt = [
            block_hash
            for block_id, block_hash in zip(transfer.block_ids, transfer.block_hashes, strict=True)
            if block_id in invalid_block_ids
        ]
        if corrupt:
            self._index.discard(transfer.group, corrupt)
            self._record_evictions()

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def reset_cache(self) -> bool | None:
        emptied = self._index.clear()
        self._record_evictions()
        return emptied

    # ----------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from kvwire.blocks.paged_cache import group_caches

        self._worker = CPUPoolWorker(
            layouts=self.group_layouts,
            caches=group_caches(kv_caches, self._layout, self._groups),
            num_slots=self.num_slots,
            io_threads=self._options["io_threads"],
            counters=self._counters,
            transfer_timeout_s=self._options["transfer_timeout_s"],
        )
        logger.info(
            "CPUOffloadConnector: a pool of %d blocks of %d bytes (%.1f MiB), %d KV cache groups",
            self.num_slots,
            self._layout.payload_bytes,
            self.num_slots * self._layout.entry_bytes / 2**20,
            len(self._groups),
        )

    def _worker_and_metadata(self) -> tuple[CPUPoolWorker, CPUOffloadMetadata]:
        worker = self._require_worker()
        metadata = self._get_connector_metadata()
        return worker, metadata_of_type(type(self).__name__, metadata, CPUOffloadMetadata)

    def _release_saves(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Release the stores reading blocks this step writes; wait out preempted ones' stores."""
        metadata = metadata_of_type(type(self).__name__, kv_connector_metadata, CPUOffloadMetadata)
        worker = self._require_worker()
        self._released_stores += worker.release_stores_reading(metadata.new_block_ids)
        if metadata.preempted_req_ids:
            worker.wait_for_requests(metadata.preempted_req_ids)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        worker, metadata = self._worker_and_metadata()
        self._counters.add_many(dict(metadata.counters))
        self._pending_release.add(metadata.release_req_ids)
        self._release_saves_once(metadata)
        worker.start_loads(metadata.loads, metadata.async_loads)

    def wait_for_save(self) -> None:
        worker, metadata = self._worker_and_metadata()
        stores, left_out = self._saves_from_good_context(metadata.stores)
        # Reported so that the scheduler side frees their slots: the blocks,
        # computed again, are stored anew.
        self._left_out_stores += left_out
        # The copies run in the background: blocks being stored belong to
        # running requests (or finished ones whose blocks are kept); one freed
        # meanwhile and given to a request is released before it is written
        # (handle_preemptions).
        worker.store(stores)

    def build_connector_worker_meta(self) -> CPUOffloadWorkerMetadata | None:
        released, self._released_stores = self._released_stores, []
        left_out, self._left_out_stores = self._left_out_stores, []
        if not (released or left_out):
            return None
        return CPUOffloadWorkerMetadata(tuple(released), tuple(left_out))

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self._counters.take_stats()

    def wait_for_pending_saves(self, timeout_s: float | None = None) -> bool:
        """Block until every store into the pool started so far is complete."""
        return self._worker.wait_for_all(timeout_s) if self._worker is not None else True

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
