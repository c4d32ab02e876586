"""The offload connector's scheduler half: lookups, each step's plan, the medium's bookkeeping.

Pure bookkeeping, no tensors and no transfers: it asks the medium's
`kvwire.media.MediumIndex` what it holds, plans loads and saves
with the `BlockPlanner`, and ships
them to the worker half in an `OffloadMetadata`.

A save's blocks are read in place in the background, so a request with
saves not yet settled (or an asynchronous load still writing) keeps its
blocks when it finishes, until the worker half reports it finished sending;
only then does the index publish its saved blocks. Saves the worker did not
make (released, or left out after a failed load) come back in
`OffloadWorkerMetadata` and are
settled as failed: the index never publishes them.

A load that failed is never offered to its request again, from its first
failed block on, whichever medium made it (the planner remembers where,
until the request finishes): vLLM looks a request up again as soon as its
asynchronous load failed, the same load would fail the same way, and any
new asynchronous load of it can stall vLLM's admission when the KV cache is
short (see `loads_failed`).
A medium whose loads keep failing has its hits withheld for a while
(`kvwire.connectors.offload._load_breaker`).

With a `lookup_deadline_s` (the `async_lookup` option), a medium whose
index declares `MediumIndex.concurrent_lookups`
is looked up on a lookup thread: the lookup answers None until the thread
has, and a miss past the deadline
(`kvwire.connectors.offload._async_lookups`).

A request whose `kv_transfer_params` hold `max_load_tokens` loads at most
that many tokens past its local hit, in whole blocks (vLLM's offloading
connector reads the same key); the blocks past it are not looked up, and
counted in `load_blocks_capped`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import attrs

from kvwire.blocks.transfers import BlockTransfer
from kvwire.common.redaction import SHOWN_LENGTH, redact_text, shown
from kvwire.connectors.offload._async_lookups import AsyncLookups
from kvwire.connectors.offload._load_breaker import LoadBreaker
from kvwire.connectors.offload._planner import BlockPlanner, HitCounter
from kvwire.connectors.offload.metadata import OffloadMetadata, of_worker_metadata
from kvwire.interface.types import (
    BlockHash,
    KVCacheBlocks,
    KVCacheEvent,
    KVConnectorOutput,
    Request,
    SchedulerOutput,
)
from kvwire.media.base import LoadSpec, MediumIndex
from kvwire.media.rate_limited import RateLimitedWarning

__all__ = ["OffloadSchedulerHalf"]

logger = logging.getLogger(__name__)


@attrs.define
class _RequestState:
    """A request's transfers the medium's index has not settled yet.

    `unsettled_saves` holds, per KV cache group, the hashes of blocks whose
    save was planned and not yet settled; `async_loads` its background loads.
    """

    unsettled_saves: tuple[list[BlockHash], ...]
    async_loads: list[BlockTransfer] = attrs.field(factory=list)

    @property
    def busy(self) -> bool:
        return bool(self.async_loads) or any(self.unsettled_saves)


class OffloadSchedulerHalf:
    """The scheduler half of one offload connector: its state and calls.

    `lookup_deadline_s`: look the medium up on a lookup thread, a miss
    after that many seconds; None looks it up on the scheduler's thread.
    """

    def __init__(
        self,
        *,
        index: MediumIndex,
        planner: BlockPlanner,
        num_groups: int,
        async_load: bool,
        medium: str = "the medium",
        load_breaker: LoadBreaker | None = None,
        lookup_deadline_s: float | None = None,
    ) -> None:
        self._index = index
        # Names the medium in warnings about its index's answers.
        self._medium = medium
        self._warn = RateLimitedWarning(logger)
        self._breaker = load_breaker if load_breaker is not None else LoadBreaker(medium)
        # Bound once: a lookup per request and step passes one of the two.
        self._count_held = self._count_held_prefix
        self._planner = planner
        self._num_groups = num_groups
        self._async_load = async_load
        self._requests: dict[str, _RequestState] = {}
        self._finished: dict[str, _RequestState] = {}
        self._step_loads: list[BlockTransfer] = []
        self._step_async_loads: list[BlockTransfer] = []
        # Synchronous loads end within their step: settled at the next output.
        self._sync_loads_in_flight: list[BlockTransfer] = []
        self._release_req_ids: list[str] = []
        self._forwarded_events: list[KVCacheEvent] = []
        # A medium that places nothing (entries found by key) takes every
        # save as planned: no per-block bookkeeping to build each step.
        self._places_saves = type(index).prepare_save is not MediumIndex.prepare_save
        # A deadline asks for lookups off the scheduler's thread; an index
        # whose lookups touch its scheduler-side state answers on it.
        self._async_lookups = (
            AsyncLookups(planner.probe, self._count_held, deadline_s=lookup_deadline_s)
            if lookup_deadline_s is not None and index.concurrent_lookups
            else None
        )

    @property
    def index(self) -> MediumIndex:
        return self._index

    @property
    def planner(self) -> BlockPlanner:
        return self._planner

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        count: HitCounter = self._count_held
        max_load_tokens = self._max_load_tokens(request)
        if not self._breaker.offers_hits():
            count = _held_nowhere
        elif self._async_lookups is not None:
            span = self._planner.lookup_span(request, num_computed_tokens, max_load_tokens)
            answers = self._async_lookups.answers(request.request_id, span)
            if answers is None:
                return None, False
            count = answers.count
        hits = self._planner.look_up(request, num_computed_tokens, count, max_load_tokens)
        return hits * self._planner.block_size, self._async_load and hits > 0

    def _max_load_tokens(self, request: Request) -> int | None:
        """The request's `max_load_tokens` from its `kv_transfer_params`; None for none.

        The value is the user's: one that is no count of tokens is ignored,
        with a warning, and the request loads what the medium holds.
        """
        params = request.kv_transfer_params
        if not isinstance(params, Mapping):
            return None
        raw = params.get("max_load_tokens")
        if raw is None:
            return None
        if isinstance(raw, int) and not isinstance(raw, bool) and raw >= 0:
            return raw
        self._warn.warn(
            "max-load-tokens-invalid",
            "request %s: kv_transfer_params.max_load_tokens is %s, not an integer >= 0 or "
            "null; ignored",
            shown(request.request_id),
            shown(raw),
        )
        return None

    def _count_held_prefix(self, group: int, block_hashes: Sequence[BlockHash]) -> int:
        """The index's count, checked: an error or an answer that is no count of them is a miss.

        The index may be a plug-in's (or its store's `count_prefix`): a
        count beyond the blocks asked, a string, a float or an exception must
        neither reach the planner nor print the plug-in's message raw.
        """
        try:
            held = self._index.count_held_prefix(group, block_hashes)
        except Exception as error:
            self._warn.warn(
                "count-raised",
                "%s: looking up %d blocks raised %s: %s; counted as a miss",
                self._medium,
                len(block_hashes),
                type(error).__name__,
                redact_text(str(error))[:SHOWN_LENGTH],
            )
            return 0
        if isinstance(held, int) and not isinstance(held, bool) and 0 <= held <= len(block_hashes):
            return held
        self._warn.warn(
            "count-invalid",
            "%s: looking up %d blocks answered %s, not a count from 0 to %d; counted as a miss",
            self._medium,
            len(block_hashes),
            shown(held),
            len(block_hashes),
        )
        return 0

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        previous = self._requests.get(request.request_id)
        # Resumed after preemption: its saves still count.
        state = _RequestState(
            previous.unsettled_saves
            if previous is not None
            else tuple([] for _ in range(self._num_groups))
        )
        self._requests[request.request_id] = state
        transfers: list[BlockTransfer] = []
        try:
            for load in self._planner.allocate(request, blocks, num_external_tokens):
                spec = self._prepare_load(load)
                if spec.slots or spec.payload is not None:
                    load = attrs.evolve(load, slots=spec.slots, payload=spec.payload)
                transfers.append(load)
        except ValueError as error:
            # Every group's blocks or none: the groups prepared already let go.
            for transfer in transfers:
                self._index.complete_load(
                    transfer.group, transfer.block_hashes, (), payload=transfer.payload
                )
            raise ValueError(
                f"update_state_after_alloc: request {request.request_id!r} asks for "
                f"{num_external_tokens} external tokens; {error}"
            ) from None
        if transfers:
            self._breaker.load_started()
        if self._async_load:
            state.async_loads.extend(transfers)
            self._step_async_loads.extend(transfers)
        else:
            self._step_loads.extend(transfers)

    def _prepare_load(self, load: BlockTransfer) -> LoadSpec:
        """The index's `prepare_load` of `load`'s blocks, checked to be a `LoadSpec`."""
        spec = self._index.prepare_load(load.group, load.block_hashes)
        if not isinstance(spec, LoadSpec):
            raise TypeError(
                f"{type(self._index).__name__}.prepare_load returned {shown(spec)}; expected a "
                "kvwire.media.LoadSpec (its slots and payload)"
            )
        return spec

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadMetadata:
        saves = [
            placed
            for save in self._planner.plan_saves(scheduler_output)
            if (placed := self._place_save(save)) is not None
        ]
        for request_id in scheduler_output.finished_req_ids:
            self._forget(request_id)
        hit_blocks, miss_blocks, capped_blocks = self._planner.take_lookup_counts()
        counters = {
            "lookup_hit_blocks": hit_blocks,
            "lookup_miss_blocks": miss_blocks,
            "load_blocks_capped": capped_blocks,
        }
        counters.update(self._index.take_counters())
        counters.update(self._breaker.take_counters())
        if self._async_lookups is not None:
            counters.update(self._async_lookups.take_counters())
        metadata = OffloadMetadata(
            loads=tuple(self._step_loads),
            async_loads=tuple(self._step_async_loads),
            saves=tuple(saves),
            release_req_ids=tuple(self._release_req_ids),
            preempted_req_ids=tuple(sorted(scheduler_output.preempted_req_ids)),
            new_block_ids=frozenset(self._planner.take_new_block_ids()),
            counters=tuple(sorted((name, n) for name, n in counters.items() if n)),
            idle=scheduler_output.total_num_scheduled_tokens == 0,
            # After every prepare_load and prepare_save of the step: all its evictions.
            medium_payload=self._index.take_step_payload(),
        )
        self._sync_loads_in_flight.extend(self._step_loads)
        self._step_loads = []
        self._step_async_loads = []
        self._release_req_ids = []
        return metadata

    def _place_save(self, save: BlockTransfer) -> BlockTransfer | None:
        """The part of `save` the medium takes, with its places; None when it takes nothing."""
        wanted = save.block_hashes
        state = self._requests.get(save.request_id)
        if not self._places_saves:
            if state is not None:
                state.unsettled_saves[save.group].extend(wanted)
            return save
        placed = dict(self._index.prepare_save(save.group, wanted))
        if not placed:
            return None
        if state is not None:
            state.unsettled_saves[save.group].extend(placed)
        if len(placed) == len(wanted) and all(slot is None for slot in placed.values()):
            return save
        positions = [i for i, block_hash in enumerate(wanted) if block_hash in placed]
        # Slots when the medium places blocks; none when it saves by key.
        slots = tuple(slot for i in positions if (slot := placed[wanted[i]]) is not None)
        if slots and len(slots) != len(positions):
            raise TypeError(
                f"{type(self._index).__name__}.prepare_save gave a slot to some blocks of one "
                "save and None to others; expected a slot for every block it takes, or None "
                "for every one"
            )
        taken = tuple(wanted[i] for i in positions)
        return attrs.evolve(
            save,
            block_ids=tuple(save.block_ids[i] for i in positions),
            block_hashes=taken,
            slots=slots,
        )

    def request_finished(self, request: Request) -> bool:
        """Forget the finished `request`; whether its blocks, in every group, must be kept.

        True while a save may still read them or a background load write
        them; the worker half then reports the request finished sending
        once no transfer of it runs.
        """
        self._forget(request.request_id)
        state = self._requests.pop(request.request_id, None)
        if state is None or not state.busy:
            return False
        self._finished[request.request_id] = state
        self._release_req_ids.append(request.request_id)
        return True

    def _forget(self, request_id: str) -> None:
        self._planner.forget(request_id)
        if self._async_lookups is not None:
            self._async_lookups.forget(request_id)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        invalid = connector_output.invalid_block_ids
        self._planner.loads_failed(invalid)
        # Before finished_sending below: a request's saves released (or left
        # out) in the step that reports it finished must not be published
        # with the rest.
        worker_meta = connector_output.kv_connector_worker_meta
        if worker_meta is not None:
            report = of_worker_metadata(worker_meta)
            for save in (*report.left_out_saves, *report.released_saves):
                self._drop_save(save)
        if self._sync_loads_in_flight:
            self._end_loads(self._sync_loads_in_flight, invalid)
            self._sync_loads_in_flight = []
        for request_id in connector_output.finished_recving or ():
            state = self._requests.get(request_id) or self._finished.get(request_id)
            if state is not None and state.async_loads:
                self._end_loads(state.async_loads, invalid)
                state.async_loads = []
        for request_id in connector_output.finished_sending or ():
            state = self._finished.pop(request_id, None)
            if state is None:
                continue
            if state.async_loads:
                self._end_loads(state.async_loads, invalid)
            for group, hashes in enumerate(state.unsettled_saves):
                if hashes:
                    self._index.complete_save(group, hashes, success=True)
        # Events the worker half saw (a store medium's): handed on, in order.
        self._forwarded_events.extend(connector_output.kv_cache_events)

    def _drop_save(self, save: BlockTransfer) -> None:
        """Settle a save the worker did not make: its blocks must never become hits."""
        self._index.complete_save(save.group, save.block_hashes, success=False)
        state = self._requests.get(save.request_id) or self._finished.get(save.request_id)
        if state is not None:
            dropped = set(save.block_hashes)
            unsettled = state.unsettled_saves[save.group]
            unsettled[:] = [h for h in unsettled if h not in dropped]

    def _end_loads(self, transfers: Sequence[BlockTransfer], invalid_block_ids: set[int]) -> None:
        """Settle ended loads with the index; tell the breaker how each request's load ended."""
        failed_by_request: dict[str, bool] = {}
        for transfer in transfers:
            corrupt: Sequence[BlockHash] = [
                block_hash
                for block_id, block_hash in zip(
                    transfer.block_ids, transfer.block_hashes, strict=True
                )
                if block_id in invalid_block_ids
            ]
            self._index.complete_load(
                transfer.group, transfer.block_hashes, corrupt, payload=transfer.payload
            )
            request_id = transfer.request_id
            failed_by_request[request_id] = failed_by_request.get(request_id, False) or bool(
                corrupt
            )
        for failed in failed_by_request.values():
            self._breaker.load_ended(failed=failed)

    @property
    def load_breaker(self) -> LoadBreaker:
        return self._breaker

    def take_events(self) -> list[KVCacheEvent]:
        events = self._index.take_events()
        if self._forwarded_events:
            events = [*events, *self._forwarded_events]
            self._forwarded_events = []
        return events

    def reset_cache(self) -> bool | None:
        return self._index.reset()

    def close(self) -> None:
        if self._async_lookups is not None:
            self._async_lookups.close()
        self._index.close()


def _held_nowhere(group: int, block_hashes: Sequence[BlockHash]) -> int:
    """The count of a medium whose hits are withheld (see `LoadBreaker`)."""
    return 0
