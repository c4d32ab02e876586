"""The tiered medium's worker half: the CPU pool's copies, and the secondary tiers behind it.

`TieredTransferHandler` holds the CPU pool's handler and each secondary
tier's own handler, built over the pool's memory instead of the engine's
cache (`pool_layer_views`: a tier's "block id" is a pool slot), and uses each
through its public calls. A tier therefore moves blocks between its medium
and the pool only, and its entries are the ones it would store from the
engine's cache, byte for byte. Every tier job (a promotion: tier to pool; a
spill or a write-through: pool to tier) is a piece of a job of that tier's
`JobLedger`, delegated to the tier's handler: the tier runs it on its own
I/O threads, drops it (a store's `max_save_bytes_in_flight`), releases it,
gives it up at its deadline and counts it as any job of its own; the ledger
tracks which pool slots each tier job uses until the tier reports it ended.

- a load's payload (`kvwire.media.tiered.index.TieredLoad`) says where each
  block is; the blocks found in a tier are read into their pool slots on the
  pool's load thread (the pool's `fill_slots` hook; the tier's own threads
  do the I/O), one tier job per `TierSpan` with the tier's own payload, their
  pool headers written once the tier verified them, then copied into the
  cache with the pool's blocks; a block the tier fails is a load error;
- a span read straight into the cache (`TierSpan.direct`: the medium does
  not promote) is a job of the tier's second handler, built over the
  engine's cache with a deadline at most half the pool's; it is submitted
  only while that deadline falls before the load's own, and waited for until
  it ended, so it writes nothing into the cache once the load gave up on
  its blocks (a span too late for that is a load error, read from nowhere);
- a load of a block another load brings in (`Place.ARRIVING`: the scheduler
  half gave both the same slot) waits until that load's read of the slot
  ended, at most until its own deadline, then copies the slot as a pool
  block: verified by its header, so a read that failed fails this block too;
- a save's blocks whose slot is the one past the pool's memory (the index
  writes them around the pool: `TieredIndex`'s `write_around`) are written
  to every tier straight from the cache, by the tiers' handlers built over
  it; the save job ends once its pool part and those writes all ended, and
  a release of blocks about to be written stops those writes too;
- a step's spills (`begin_step` with `kvwire.media.tiered.index.Spills`) and
  a write-through (once a pool save job ended) write pool slots whose headers
  name their blocks to every tier. The spills of the slots the step's
  promotions take are submitted at once, before the loads, each first copied
  into a spill buffer while one is free (`spill_buffers` entries after the
  pool's slots, which the tiers' handlers see as slots too): the promotion
  then writes its slot without waiting for the tier's write. The other
  spills are held until a job that writes their slots is submitted (the
  step's saves, after the forward pass) or the next step begins, so that
  their writes do not contend with the step's loads and forward pass for
  the cores and the GIL;
- nothing writes a pool slot while a tier job uses it: a pool save (the
  pool's `before_writing_slots` hook), or a load into the slot, first waits
  for the tier jobs using it, at most `TIER_WRITE_WAIT_S`; a tier write
  still running then is given up on (the tier commits nothing of it:
  `tier<N>.writes_released`), so a slow tier costs writes to it, never a
  stall of the pool.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence, Set

import attrs
import torch

from kvwire.blocks.format import HEADER_SIZE, BlockLayout, headers_without_checksum
from kvwire.blocks.groups import CacheGroup
from kvwire.blocks.paged_cache import PagedKVCaches
from kvwire.blocks.transfers import BlockTransfer, TransferPayload
from kvwire.exceptions import KVWireError
from kvwire.interface.counters import Counters
from kvwire.interface.types import BlockHash, KVCacheEvent
from kvwire.media.base import JobResult, Medium, TransferHandler, TransferJob, TransferKind
from kvwire.media.cpu_pool.handler import CPUPoolTransferHandler, SlotsFilled
from kvwire.media.jobs import JobLedger, JobPiece
from kvwire.media.rate_limited import RateLimitedWarning
from kvwire.media.shutdown import close_in_steps
from kvwire.media.tiered.index import (
    Place,
    SpilledBlocks,
    Spills,
    TieredLoad,
    TierSpan,
    tier_prefix,
)

__all__ = ["TIER_WRITE_WAIT_S", "TieredTransferHandler"]

logger = logging.getLogger(__name__)

TIER_WRITE_WAIT_S = 1.0
"""How long a pool write waits for a tier's write of the same slot before giving it up."""


class _SlotsInUse(KVWireError, RuntimeError):
    """A pool slot about to be written is still written by a tier's load: it is left alone."""


class _Tier:
    """One secondary tier: its handler over the pool, its counters, and the ledger of its jobs.

    Each tier job is a ledger job of one piece, delegated to the tier's
    handler; its blocks are pool slots, so the ledger knows which jobs use a
    slot. Thread-safe: the engine's thread submits and polls, the pool's
    copy threads wait for slots and run loads.
    """

    def __init__(
        self,
        number: int,
        handler: TransferHandler,
        counters: Counters,
        *,
        warn: RateLimitedWarning,
        transfer_timeout_s: float,
    ) -> None:
        self.number = number
        self.handler = handler
        self.counters = counters
        # Every piece is delegated: the tier's handler gives it up at the tier's
        # own deadline and counts it, so this ledger never counts nor warns.
        self.jobs: JobLedger[JobPiece] = JobLedger(
            counters=counters,
            warn=warn,
            label=f"tier {number}: ",
            transfer_timeout_s=transfer_timeout_s,
        )
        self._job_ids = itertools.count()

    def submit(self, kind: TransferKind, transfer: BlockTransfer) -> JobPiece:
        """Start a job over pool slots (the transfer's block ids) on the tier; its one piece."""
        job = TransferJob(next(self._job_ids), kind, (transfer,))
        piece = JobPiece(job.job_id, job.transfers, self.jobs.begin(job))
        try:
            self.jobs.delegate(piece, self.handler)
        finally:
            self.jobs.submitted(job.job_id)
        return piece

    def wait_for_slots(self, slots: Sequence[int], until: float) -> bool:
        """Wait until no job of this tier uses `slots`, or `until`; whether none does."""
        job_ids = self.jobs.jobs_moving(slots)
        return not job_ids or self.jobs.wait(job_ids, until)

    def loads_using(self, slots: Sequence[int]) -> bool:
        """Whether a load of this tier still writes one of `slots`."""
        return bool(self.jobs.jobs_moving(slots, TransferKind.LOAD))

    def load(self, transfer: BlockTransfer, until: float | None) -> set[int]:
        """Read `transfer`'s blocks into their slots (its block ids); the slots that failed.

        Without `until`, it returns once the job ended or was given up on at
        the tier's own deadline.
        """
        piece = self.submit(TransferKind.LOAD, transfer)
        if not self.jobs.wait([piece.job_id], until) or not piece.ended:
            # Still running: it may yet write the slots, which stay in use
            # until it ends; the blocks are load errors now.
            return set(transfer.block_ids)
        return set(piece.failed)


class TieredTransferHandler(TransferHandler):
    """The CPU pool's handler, with `tiers` (media) each built over the pool's memory.

    The pool's arguments (`layouts` to `transfer_timeout_s`) are
    `CPUPoolTransferHandler`'s; `spill_buffers` entries more are allocated
    after the pool's `num_slots` for the spills of promotions' slots.
    `direct`: each tier's medium again (one per tier, in order) and the
    engine's caches, when the tiers' blocks are read straight into the cache
    (`TierSpan.direct`) or written straight from it (around the pool); the
    media's `transfer_timeout_s` is at most half the pool's.
    """

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
        spill_buffers: int = 0,
        direct: tuple[Sequence[Medium], Mapping[str, torch.Tensor]] | None = None,
    ) -> None:
        if spill_buffers < 0:
            raise ValueError(f"spill_buffers is a number of entries, >= 0; got {spill_buffers}")
        self._pool = CPUPoolTransferHandler(
            layouts=layouts,
            caches=caches,
            num_slots=num_slots + spill_buffers,
            io_threads=io_threads,
            counters=counters,
            transfer_timeout_s=transfer_timeout_s,
            before_writing_slots=self._before_writing_slots,
            fill_slots=self._fill_slots,
        )
        self._layouts = self._pool.layouts
        self._slots = self._pool.pool
        self._counters = counters
        self._write_through = write_through
        # Each pool save job's transfers until it ended: then they are written through.
        self._saves: dict[int, tuple[BlockTransfer, ...]] = {}
        # Saves written around the pool: each job's tier jobs, and its pool part's
        # result until they all ended (a job with no pool part ended there at once).
        self._around_slot = num_slots + spill_buffers
        self._around_writes: dict[int, list[tuple[_Tier, int]]] = {}
        self._around_results: dict[int, JobResult] = {}
        # Spills not submitted yet: each before the next job that writes its slots.
        self._held_spills: list[SpilledBlocks] = []
        # Pool slots a submitted load reads a tier's block into, each with an
        # event set once that read ended: a load sharing the block waits for it.
        self._arrivals: dict[int, threading.Event] = {}
        self._arrivals_lock = threading.Lock()
        # The spill buffers no tier write reads, and those the submitted writes read.
        self._free_buffers = list(range(num_slots, num_slots + spill_buffers))
        self._buffers_written: list[tuple[int, ...]] = []
        pool_caches = pool_layer_views(self._slots.payloads, self._layouts[0].cache_layout, groups)
        warn = RateLimitedWarning(logger)
        self._tiers: list[_Tier] = []
        # Each tier's handler over the engine's cache, for direct spans (else none).
        self._direct: list[_Tier] = []
        self._direct_timeout_s = 0.0
        try:
            for number, medium in enumerate(tiers, 1):
                tier_counters = Counters()
                handler = medium.build_handler(pool_caches, tier_counters)
                self._tiers.append(
                    _Tier(
                        number,
                        handler,
                        tier_counters,
                        warn=warn,
                        transfer_timeout_s=transfer_timeout_s,
                    )
                )
            if direct is not None:
                media, kv_caches = direct
                for tier, medium in zip(self._tiers, media, strict=True):
                    timeout_s = float(medium.context.options["transfer_timeout_s"])
                    self._direct_timeout_s = max(self._direct_timeout_s, timeout_s)
                    handler = medium.build_handler(kv_caches, tier.counters)
                    self._direct.append(
                        _Tier(
                            tier.number,
                            handler,
                            tier.counters,
                            warn=warn,
                            transfer_timeout_s=timeout_s,
                        )
                    )
        except BaseException:
            for tier in (*self._tiers, *self._direct):
                tier.handler.close()
            self._pool.close()
            raise

    # ------------------------------------------------------------- the calls

    def submit(self, job: TransferJob) -> None:
        if job.kind is TransferKind.SAVE and self._direct:
            pool_job = self._write_around(job)
            if pool_job is None:
                return
            job = pool_job
        # A spill reads its slot before anything writes it again: submitted first.
        if job.kind is TransferKind.SAVE:
            self._submit_held_spills()
        else:
            self._submit_held_spills({slot for t in job.transfers for slot in t.slots})
        if self._write_through and job.kind is TransferKind.SAVE:
            self._saves[job.job_id] = job.transfers
        if job.kind is TransferKind.LOAD:
            # Before any piece runs: a piece sharing a block may run first.
            self._expect_arrivals(_tier_slots(job.transfers))
        self._pool.submit(job)

    def _write_around(self, job: TransferJob) -> TransferJob | None:
        """Write the save's blocks the pool does not take to every tier; the pool's part.

        None when the pool takes none of them.
        """
        around_slot = self._around_slot
        if not any(around_slot in transfer.slots for transfer in job.transfers):
            return job
        in_pool: list[BlockTransfer] = []
        writes: list[tuple[_Tier, int]] = []
        for transfer in job.transfers:
            positions = range(len(transfer.slots))
            kept = [p for p in positions if transfer.slots[p] != around_slot]
            if len(kept) == len(transfer.slots):
                in_pool.append(transfer)
                continue
            if kept:
                in_pool.append(_positions_of(transfer, kept))
            around = attrs.evolve(
                _positions_of(transfer, [p for p in positions if transfer.slots[p] == around_slot]),
                slots=(),
            )
            for tier in self._direct:
                tier.counters.add("written_around_blocks", len(around.block_ids))
                writes.append((tier, tier.submit(TransferKind.SAVE, around).job_id))
        self._around_writes[job.job_id] = writes
        if not in_pool:
            self._around_results[job.job_id] = JobResult(job.job_id)
            return None
        return TransferJob(job.job_id, job.kind, tuple(in_pool))

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
        """The pool's ended jobs; a save's blocks then go to the tiers (`write_through`).

        The tiers' jobs that ended free their slots; their results were read
        by the loads that waited for them.
        """
        results = self._pool.poll()
        for tier in (*self._tiers, *self._direct):
            tier.jobs.poll()
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
        if not self._around_writes:
            return results
        ended = []
        for result in results:
            if result.job_id in self._around_writes:
                self._around_results[result.job_id] = result
            else:
                ended.append(result)
        for job_id, result in list(self._around_results.items()):
            if not any(tier.jobs.is_running(write) for tier, write in self._around_writes[job_id]):
                del self._around_writes[job_id], self._around_results[job_id]
                ended.append(result)
        return ended

    def wait(self, job_ids: Iterable[int], until: float | None = None) -> bool:
        """Block until these jobs ended (given up on past their deadline), or `until`.

        A save's writes around the pool are waited for with its pool part.
        """
        job_ids = list(job_ids)
        ended = self._pool.wait(job_ids, until)
        for job_id in job_ids:
            for tier, write in self._around_writes.get(job_id, ()):
                ended = tier.jobs.wait([write], until) and ended
        return ended

    def release_saves_reading(
        self, request_ids: Iterable[str], block_ids: Set[int]
    ) -> list[BlockTransfer]:
        """The saves reading these: the pool's (see `CPUPoolTransferHandler.release_saves_reading`),
        and the writes around the pool."""
        request_ids = list(request_ids)
        stopped = self._pool.release_saves_reading(request_ids, block_ids)
        # One write around the pool per tier, each of the same transfer: reported once.
        around = {
            id(transfer): transfer
            for tier in self._direct
            for transfer in tier.handler.release_saves_reading(request_ids, block_ids)
        }
        return stopped + list(around.values())

    def begin_step(self, payload: TransferPayload) -> None:
        """Write the step's spills (`Spills`) from their pool slots to the tiers; only submits.

        Those of the slots its promotions take go now; the others are held
        until a job that writes their slots is submitted, or the next step.
        """
        if not isinstance(payload, Spills):
            raise TypeError(
                f"tiered offload: a step's payload is {type(payload).__name__}, expected Spills"
            )
        self._submit_held_spills()
        for spilled in payload.groups:
            if spilled.for_promotion:
                self._spill_for_promotion(spilled)
            else:
                self._held_spills.append(spilled)

    def _spill_for_promotion(self, spilled: SpilledBlocks) -> None:
        """Write blocks whose slots a promotion takes: through spill buffers while any is free.

        Their slots are then free for the promotions' reads at once; the
        blocks beyond the free buffers are written from their slots, which
        their promotions wait for.
        """
        self._reclaim_buffers()
        count = min(len(self._free_buffers), len(spilled.slots))
        if count:
            buffers = tuple(self._free_buffers[-count:])
            del self._free_buffers[-count:]
            self._slots.copy_entries(spilled.slots[:count], buffers)
            self._buffers_written.append(buffers)
            self._write_to_tiers(
                spilled.group, buffers, spilled.block_hashes[:count], "spilled_blocks"
            )
        if count < len(spilled.slots):
            self._counters.add("spills_without_buffer", len(spilled.slots) - count)
            self._write_to_tiers(
                spilled.group,
                spilled.slots[count:],
                spilled.block_hashes[count:],
                "spilled_blocks",
            )

    def _reclaim_buffers(self) -> None:
        """Free the spill buffers no tier job reads any more."""
        written = self._buffers_written
        if not written:
            return
        self._buffers_written = []
        for buffers in written:
            if any(tier.jobs.jobs_moving(buffers) for tier in self._tiers):
                self._buffers_written.append(buffers)
            else:
                self._free_buffers += buffers

    def _submit_held_spills(self, slots: Set[int] | None = None) -> None:
        """Submit the held spills (those of any of `slots`; all when None), in order."""
        if not self._held_spills:
            return
        held, self._held_spills = self._held_spills, []
        for spilled in held:
            if slots is None or not slots.isdisjoint(spilled.slots):
                self._spill(spilled)
            else:
                self._held_spills.append(spilled)

    def _spill(self, spilled: SpilledBlocks) -> None:
        self._write_to_tiers(spilled.group, spilled.slots, spilled.block_hashes, "spilled_blocks")

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
            tier.submit(TransferKind.SAVE, write)

    def _named_slots(
        self, group: int, slots: tuple[int, ...], hashes: tuple[BlockHash, ...]
    ) -> tuple[tuple[int, ...], tuple[BlockHash, ...]]:
        """The pool slots (and hashes) of `group` whose headers name their block.

        Only those were saved whole: a slot whose save failed, was given up
        on or never ran must never reach a tier.
        """
        layout = self._layouts[group]
        expected = headers_without_checksum(layout, hashes)
        actual = self._slots.headers(slots)
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

    def _fill_slots(self, job: JobPiece) -> SlotsFilled | None:
        """Bring in the piece's blocks found in tiers; the blocks to copy from the pool."""
        (transfer,) = job.transfers
        payload = transfer.payload
        if not isinstance(payload, TieredLoad) or all(p is Place.POOL for p in payload.places):
            return transfer, []
        failed = [
            block_id
            for block_id, place in zip(transfer.block_ids, payload.places, strict=True)
            if place is Place.MISSING
        ]
        from_pool = [p for p, place in enumerate(payload.places) if place is Place.POOL]
        arriving = [p for p, place in enumerate(payload.places) if place is Place.ARRIVING]
        started = time.perf_counter()
        try:
            for span in payload.spans:
                if job.abandoned:
                    return None
                if span.direct:
                    failed += self._read_direct(self._direct[span.tier - 1], transfer, span, job)
                    continue
                tier = self._tiers[span.tier - 1]
                brought = self._bring_in(tier, transfer, span, job.deadline)
                from_pool += brought
                failed += [
                    transfer.block_ids[p] for p in range(span.start, span.stop) if p not in brought
                ]
        finally:
            self._arrived(_tier_slots((transfer,)))
        self._wait_for_arrivals([transfer.slots[p] for p in arriving], job.deadline)
        self._counters.add("promotion_seconds", time.perf_counter() - started)
        return _positions_of(transfer, sorted(from_pool + arriving)), failed

    def _read_direct(
        self, tier: _Tier, transfer: BlockTransfer, span: TierSpan, job: JobPiece
    ) -> list[int]:
        """Read the span's blocks from `tier` straight into their cache blocks; the ids that failed.

        Only while the tier's deadline falls before the load's: the wait
        returns once the tier's job ended or was given up on (it then writes
        nothing more), before the load itself is given up on.
        """
        block_ids = transfer.block_ids[span.start : span.stop]
        if time.monotonic() + self._direct_timeout_s >= job.deadline:
            self._counters.add("direct_reads_too_late", len(block_ids))
            return list(block_ids)
        failed = tier.load(
            BlockTransfer(
                request_id=transfer.request_id,
                group=transfer.group,
                block_ids=block_ids,
                block_hashes=transfer.block_hashes[span.start : span.stop],
                payload=span.payload,
            ),
            None,
        )
        return [block_id for block_id in block_ids if block_id in failed]

    def _bring_in(
        self, tier: _Tier, transfer: BlockTransfer, span: TierSpan, deadline: float
    ) -> list[int]:
        """Read the span's blocks from `tier` into their pool slots; the positions it brought in."""
        positions = range(span.start, span.stop)
        slots = transfer.slots[span.start : span.stop]
        hashes = transfer.block_hashes[span.start : span.stop]
        waited_from = time.perf_counter()
        try:
            self._before_writing_slots(slots, deadline)
        except _SlotsInUse as error:
            logger.warning("tiered offload: not loading %d blocks: %s", len(slots), error)
            return []
        finally:
            self._counters.add("promotion_wait_seconds", time.perf_counter() - waited_from)
        # Until the tier verified a block, its slot names none.
        self._slots.clear_headers(slots)
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
            self._pool.name_slots(
                transfer.group,
                [transfer.slots[p] for p in brought],
                [transfer.block_hashes[p] for p in brought],
            )
        return brought

    # ------------------------------------------------------------- reporting

    def take_events(self) -> list[KVCacheEvent]:
        events = self._pool.take_events()
        for tier in (*self._tiers, *self._direct):
            events += tier.handler.take_events()
        return events

    def take_counters(self) -> Mapping[str, float]:
        counters = dict(self._pool.take_counters())
        for tier in self._tiers:
            # The counters both of the tier's handlers add to, and the one over the
            # pool's own, as one tier's.
            counts = {**tier.counters.take(), **tier.handler.take_counters()}
            self._add_counts(counters, tier_prefix(tier.number), counts)
        for tier in self._direct:
            self._add_counts(counters, tier_prefix(tier.number), tier.handler.take_counters())
        return counters

    @staticmethod
    def _add_counts(counters: dict[str, float], prefix: str, counts: Mapping[str, float]) -> None:
        for name, amount in counts.items():
            if amount:
                counters[prefix + name] = counters.get(prefix + name, 0) + amount

    def close(self, timeout_s: float = 30.0) -> None:
        """The pool's jobs end first (they may wait for the tiers), then each tier closes."""
        steps = [
            ("writing the spills held", self._submit_held_spills),
            ("closing the pool", lambda: self._pool.close(timeout_s)),
        ]
        steps += [(f"closing tier {tier.number}", tier.handler.close) for tier in self._tiers]
        steps += [
            (f"closing tier {tier.number}'s reads into the cache", tier.handler.close)
            for tier in self._direct
        ]
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
