"""The tiered medium's worker half: the CPU pool's copies, and the secondary tiers behind it.

`TieredTransferHandler` is the CPU pool's handler with each secondary tier's
own handler built over the pool's memory instead of the engine's cache
(`pool_layer_views`: a tier's "block id" is a pool slot). A tier therefore
moves blocks between its medium and the pool only, and its entries are the
ones it would store from the engine's cache, byte for byte:

- a load's payload (`kvwire.media.tiered.index.TieredLoad`) says where each
  block is; the blocks found in a tier are read into their pool slots on the
  pool's load thread (the tier's own threads do the I/O), one tier job per
  `TierSpan` with the tier's own payload, their pool headers written once the
  tier verified them, then copied into the cache with the pool's blocks; a
  block the tier fails is a load error;
- a load of a block another load brings in (`Place.ARRIVING`: the scheduler
  half gave both the same slot) waits until that load's read of the slot
  ended, at most until its own deadline, then copies the slot as a pool
  block: verified by its header, so a read that failed fails this block too;
- a step's spills (`begin_step` with `kvwire.media.tiered.index.Spills`) and
  a write-through (once a pool save job ended) write pool slots whose headers
  name their blocks to every tier;
- nothing writes a pool slot while a tier job uses it: a pool save, or a
  load into the slot, first waits for the tier jobs using it, at most
  `TIER_WRITE_WAIT_S`; a tier write still running then is given up on
  (the tier commits nothing of it: `tier<N>.writes_released`), so a slow
  tier costs writes to it, never a stall of the pool.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence

import torch

from kvwire.blocks.format import HEADER_SIZE, BlockLayout, headers_without_checksum
from kvwire.blocks.groups import CacheGroup
from kvwire.blocks.paged_cache import PagedKVCaches
from kvwire.blocks.transfers import BlockTransfer, TransferPayload
from kvwire.exceptions import KVWireError
from kvwire.interface.counters import Counters
from kvwire.interface.types import BlockHash, KVCacheEvent
from kvwire.media.base import JobResult, Medium, TransferHandler, TransferJob, TransferKind
from kvwire.media.cpu_pool.handler import CPUPoolTransferHandler
from kvwire.media.jobs import JobPiece
from kvwire.media.shutdown import close_in_steps
from kvwire.media.tiered.index import Place, Spills, TieredLoad, TierSpan, tier_prefix

__all__ = ["TIER_WRITE_WAIT_S", "TieredTransferHandler"]

logger = logging.getLogger(__name__)

TIER_WRITE_WAIT_S = 1.0
"""How long a pool write waits for a tier's write of the same slot before giving it up."""


class _SlotsInUse(KVWireError, RuntimeError):
    """A pool slot about to be written is still written by a tier's load: it is left alone."""


class _Tier:
    """One secondary tier: its handler over the pool, its counters, and the slots its jobs use.

    Thread-safe: the engine's thread submits and polls, the pool's copy
    threads wait for slots and run loads.
    """

    def __init__(self, number: int, handler: TransferHandler, counters: Counters) -> None:
        self.number = number
        self.handler = handler
        self.counters = counters
        self._job_ids = itertools.count()
        self._lock = threading.Lock()
        self._users: dict[int, set[int]] = {}
        self._slots_of: dict[int, tuple[int, ...]] = {}
        self._load_results: dict[int, JobResult] = {}
        self._loads: set[int] = set()
        # Loads whose waiter stopped waiting: their results are dropped when they come.
        self._unwaited: set[int] = set()

    def submit(self, kind: TransferKind, transfers: tuple[BlockTransfer, ...]) -> int:
        """Start a job over pool slots (the transfers' block ids); its id."""
        job_id = next(self._job_ids)
        slots = tuple(slot for transfer in transfers for slot in transfer.block_ids)
        with self._lock:
            self._slots_of[job_id] = slots
            for slot in slots:
                self._users.setdefault(slot, set()).add(job_id)
            if kind is TransferKind.LOAD:
                self._loads.add(job_id)
        self.handler.submit(TransferJob(job_id, kind, transfers))
        return job_id

    def collect(self) -> None:
        """Take the jobs that ended: their slots are free of them; loads' results are kept."""
        with self._lock:
            for result in self.handler.poll():
                for slot in self._slots_of.pop(result.job_id, ()):
                    users = self._users.get(slot)
                    if users is not None:
                        users.discard(result.job_id)
                        if not users:
                            del self._users[slot]
                if result.job_id in self._loads:
                    self._loads.discard(result.job_id)
                    if result.job_id in self._unwaited:
                        self._unwaited.discard(result.job_id)
                    else:
                        self._load_results[result.job_id] = result

    def jobs_using(self, slots: Iterable[int]) -> set[int]:
        with self._lock:
            return self._jobs_using(slots)

    def loads_using(self, slots: Iterable[int]) -> bool:
        """Whether a load of this tier still writes one of `slots`."""
        with self._lock:
            return any(job_id in self._loads for job_id in self._jobs_using(slots))

    def _jobs_using(self, slots: Iterable[int]) -> set[int]:
        return {job_id for slot in slots for job_id in self._users.get(slot, ())}

    def wait_for_slots(self, slots: Sequence[int], until: float) -> bool:
        """Wait until no job of this tier uses `slots`, or `until`; whether none does."""
        job_ids = self.jobs_using(slots)
        if not job_ids:
            return True
        ended = self.handler.wait(job_ids, until)
        self.collect()
        return ended

    def load(self, transfer: BlockTransfer, until: float) -> set[int]:
        """Read `transfer`'s blocks into their slots (its block ids); the slots that failed."""
        job_id = self.submit(TransferKind.LOAD, (transfer,))
        ended = self.handler.wait([job_id], until)
        self.collect()
        with self._lock:
            result = self._load_results.pop(job_id, None)
            if result is None and job_id in self._loads:
                self._unwaited.add(job_id)
        if not ended or result is None:
            # Still running: it may yet write the slots, which stay in use
            # until it ends; the blocks are load errors now.
            return set(transfer.block_ids)
        return set(result.failed)


class TieredTransferHandler(CPUPoolTransferHandler):
    """The CPU pool's handler, with `tiers` (media) each built over the pool's memory."""

    def __init__(
        self,
        *,
        layouts: Sequence[BlockLayout],
        caches: Sequence[PagedKVCaches],
        num_slots: int,
        io_threads: int,
        counters: Counters,
        transfer_timeout_s: float = 30.0,
        tiers: Sequence[Medium],
        groups: Sequence[CacheGroup],
        write_through: bool,
    ) -> None:
        super().__init__(
            layouts=layouts,
            caches=caches,
            num_slots=num_slots,
            io_threads=io_threads,
            counters=counters,
            transfer_timeout_s=transfer_timeout_s,
        )
        self._write_through = write_through
        # Each pool save job's transfers until it ended: then they are written through.
        self._saves: dict[int, tuple[BlockTransfer, ...]] = {}
        # Pool slots a submitted load reads a tier's block into, each with an
        # event set once that read ended: a load sharing the block waits for it.
        self._arrivals: dict[int, threading.Event] = {}
        self._arrivals_lock = threading.Lock()
        pool_caches = pool_layer_views(self.pool.payloads, self._layout.cache_layout, groups)
        self._tiers: list[_Tier] = []
        try:
            for number, medium in enumerate(tiers, 1):
                counters = Counters()
                handler = medium.build_handler(pool_caches, counters)
                self._tiers.append(_Tier(number, handler, counters))
        except BaseException:
            for tier in self._tiers:
                tier.handler.close()
            super().close()
            raise

    # ------------------------------------------------------------- the calls

    def submit(self, job: TransferJob) -> None:
        if self._write_through and job.kind is TransferKind.SAVE:
            self._saves[job.job_id] = job.transfers
        if job.kind is TransferKind.LOAD:
            # Before any piece runs: a piece sharing a block may run first.
            self._expect_arrivals(_tier_slots(job.transfers))
        super().submit(job)

    def _expect_arrivals(self, slots: Iterable[int]) -> None:
        with self._arrivals_lock:
            for slot in slots:
                stale = self._arrivals.get(slot)
                if stale is not None:
                    stale.set()  # a read that never ran: nobody waits for it any more
                self._arrivals[slot] = threading.Event()

    def _arrived(self, slots: Iterable[int]) -> None:
        with self._arrivals_lock:
            for slot in slots:
                event = self._arrivals.pop(slot, None)
                if event is not None:
                    event.set()

    def _wait_for_arrivals(self, slots: Iterable[int], deadline: float) -> None:
        """Wait until the tier reads into `slots` ended, at most until `deadline`."""
        with self._arrivals_lock:
            events = [event for slot in slots if (event := self._arrivals.get(slot)) is not None]
        for event in events:
            event.wait(max(0.0, deadline - time.monotonic()))

    def poll(self) -> list[JobResult]:
        """The pool's ended jobs; a save's blocks then go to the tiers (`write_through`)."""
        results = super().poll()
        for result in results:
            transfers = self._saves.pop(result.job_id, None)
            for transfer in transfers or ():
                self._write_to_tiers(
                    transfer.group,
                    transfer.slots,
                    transfer.block_hashes,
                    "written_through_blocks",
                    request_id=transfer.request_id,
                )
        for tier in self._tiers:
            tier.collect()
        return results

    def begin_step(self, payload: TransferPayload) -> None:
        """Write the step's spills (`Spills`) from their pool slots to the tiers; only submits."""
        if not isinstance(payload, Spills):
            raise TypeError(
                f"tiered offload: a step's payload is {type(payload).__name__}, expected Spills"
            )
        for spilled in payload.groups:
            self._write_to_tiers(
                spilled.group, spilled.slots, spilled.block_hashes, "spilled_blocks"
            )

    def _write_to_tiers(
        self,
        group: int,
        slots: tuple[int, ...],
        hashes: tuple[BlockHash, ...],
        counter: str,
        *,
        request_id: str = "",
    ) -> None:
        """Submit a write of each slot whose header names its block, to every tier.

        `request_id`: the request whose save it writes through (none for a spill).
        """
        slots, hashes = self._named_slots(group, slots, hashes)
        if not slots:
            return
        write = BlockTransfer(
            request_id=request_id, group=group, block_ids=slots, block_hashes=hashes
        )
        for tier in self._tiers:
            tier.counters.add(counter, len(slots))
            tier.submit(TransferKind.SAVE, (write,))

    def _named_slots(
        self, group: int, slots: tuple[int, ...], hashes: tuple[BlockHash, ...]
    ) -> tuple[tuple[int, ...], tuple[BlockHash, ...]]:
        """The pool slots (and hashes) of `group` whose headers name their block.

        Only those were saved whole: a slot whose save failed, was given up
        on or never ran must never reach a tier.
        """
        layout = self._layouts[group]
        expected = headers_without_checksum(layout, hashes)
        actual = self.pool.headers(slots)
        if actual == expected:
            return slots, hashes
        kept = [
            i
            for i in range(len(slots))
            if actual[i * HEADER_SIZE : (i + 1) * HEADER_SIZE]
            == expected[i * HEADER_SIZE : (i + 1) * HEADER_SIZE]
        ]
        return tuple(slots[i] for i in kept), tuple(hashes[i] for i in kept)

    # ---------------------------------------------------- on the copy threads

    def _before_writing_slots(self, slots: Sequence[int], deadline: float) -> None:
        """Wait out the tier jobs using `slots`; give up the writes still running after a while.

        Raises `_SlotsInUse` when a tier job still uses one at `deadline`
        (a load that outlived it): the slots are not written then.
        """
        until = min(deadline, time.monotonic() + TIER_WRITE_WAIT_S)
        for tier in self._tiers:
            if tier.wait_for_slots(slots, until):
                continue
            released = tier.handler.release_saves_reading((), frozenset(slots))
            if released:
                tier.counters.add("writes_released", sum(len(t.block_ids) for t in released))
            # A released write commits nothing more, whatever it still reads; a
            # load may still write the slots until its own deadline.
            if not tier.wait_for_slots(slots, deadline) and tier.loads_using(slots):
                raise _SlotsInUse(
                    f"tier {tier.number}: a load into pool slots still ran at the deadline; "
                    "the slots are left as they are"
                )

    def _load(self, job: JobPiece) -> None:
        """Bring in the piece's blocks found in tiers, then copy every block into the cache."""
        (transfer,) = job.transfers
        payload = transfer.payload
        if not isinstance(payload, TieredLoad) or all(p is Place.POOL for p in payload.places):
            super()._load(job)
            return
        started = time.perf_counter()
        failed = [
            block_id
            for block_id, place in zip(transfer.block_ids, payload.places, strict=True)
            if place is Place.MISSING
        ]
        from_pool = [p for p, place in enumerate(payload.places) if place is Place.POOL]
        arriving = [p for p, place in enumerate(payload.places) if place is Place.ARRIVING]
        try:
            for span in payload.spans:
                if job.abandoned:
                    return
                tier = self._tiers[span.tier - 1]
                brought = self._bring_in(tier, transfer, span, job.deadline)
                from_pool += brought
                failed += [
                    transfer.block_ids[p] for p in range(span.start, span.stop) if p not in brought
                ]
        finally:
            self._arrived(_tier_slots((transfer,)))
        self._wait_for_arrivals([transfer.slots[p] for p in arriving], job.deadline)
        from_pool = sorted(from_pool + arriving)
        copied = self._copy_into_cache(job, _positions_of(transfer, from_pool))
        if copied is None:
            return  # its caller has reported every block of it failed
        job.failed = failed + copied
        if job.end():
            loaded = len(job.block_ids) - len(job.failed)
            self._jobs.count_load(job, loaded, self._layout.payload_bytes, started)

    def _bring_in(
        self, tier: _Tier, transfer: BlockTransfer, span: TierSpan, deadline: float
    ) -> list[int]:
        """Read the span's blocks from `tier` into their pool slots; the positions it brought in."""
        positions = range(span.start, span.stop)
        slots = transfer.slots[span.start : span.stop]
        hashes = transfer.block_hashes[span.start : span.stop]
        try:
            self._before_writing_slots(slots, deadline)
        except _SlotsInUse as error:
            logger.warning("tiered offload: not loading %d blocks: %s", len(slots), error)
            return []
        # Until the tier verified a block, its slot names none.
        self.pool.clear_headers(slots)
        failed = tier.load(
            BlockTransfer(
                request_id=transfer.request_id,
                group=transfer.group,
                block_ids=slots,
                block_hashes=hashes,
                payload=span.payload,
            ),
            deadline,
        )
        brought = [p for p, slot in zip(positions, slots, strict=True) if slot not in failed]
        if brought:
            layout = self._layouts[transfer.group]
            self._write_headers(
                layout,
                [transfer.slots[p] for p in brought],
                [transfer.block_hashes[p] for p in brought],
            )
        return brought

    # ------------------------------------------------------------- reporting

    def take_events(self) -> list[KVCacheEvent]:
        events = super().take_events()
        for tier in self._tiers:
            events += tier.handler.take_events()
        return events

    def take_counters(self) -> Mapping[str, float]:
        counters = dict(super().take_counters())
        for tier in self._tiers:
            prefix = tier_prefix(tier.number)
            counts = {**tier.counters.take(), **tier.handler.take_counters()}
            for name, amount in counts.items():
                if amount:
                    counters[prefix + name] = counters.get(prefix + name, 0) + amount
        return counters

    def close(self, timeout_s: float = 30.0) -> None:
        """The pool's jobs end first (they may wait for the tiers), then each tier closes."""
        steps = [("closing the pool", lambda: super(TieredTransferHandler, self).close(timeout_s))]
        steps += [(f"closing tier {tier.number}", tier.handler.close) for tier in self._tiers]
        close_in_steps(logger, "tiered offload: ", steps)


def _tier_slots(transfers: Iterable[BlockTransfer]) -> list[int]:
    """The pool slots these loads read tiers' blocks into (`Place.TIER`)."""
    return [
        slot
        for transfer in transfers
        if isinstance(transfer.payload, TieredLoad)
        for slot, place in zip(transfer.slots, transfer.payload.places, strict=False)
        if place is Place.TIER
    ]


def _positions_of(transfer: BlockTransfer, positions: Sequence[int]) -> BlockTransfer:
    """The blocks of `transfer` at `positions`, with their slots; no payload."""
    return BlockTransfer(
        request_id=transfer.request_id,
        group=transfer.group,
        block_ids=tuple(transfer.block_ids[p] for p in positions),
        block_hashes=tuple(transfer.block_hashes[p] for p in positions),
        slots=tuple(transfer.slots[p] for p in positions),
    )


def pool_layer_views(
    payloads: torch.Tensor, cache_layout: str, groups: Sequence[CacheGroup]
) -> dict[str, torch.Tensor]:
    """Each layer's share of the pool's payloads, shaped as that layer's paged cache would be.

    `payloads` is `[num_slots, num_layers, 2, block_size, heads, head_size]`;
    layer `i` of a group is its slots' `i`-th layer share, viewed in the
    cache layout `cache_layout` with the slots as its blocks, so a medium
    built over these views moves a pool slot as it would move a cache block,
    byte for byte. Every group's layers view the same slots.
    """
    views: dict[str, torch.Tensor] = {}
    num_slots, _, _, block_size, heads, head_size = payloads.shape
    for group in groups:
        for position, name in enumerate(group.layer_names):
            layer = payloads[:, position]
            if cache_layout == "vllm_cpu":
                views[name] = layer.view(num_slots, heads, block_size, 2 * head_size)
            else:
                views[name] = layer.transpose(0, 1)
    return views
