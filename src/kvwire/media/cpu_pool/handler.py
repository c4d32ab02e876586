"""The CPU pool medium's worker half: the pool memory and the copies.

The pool is allocated once: `num_slots` entries, each a `block_format`
header followed by one block of every layer of one KV cache group
(cross-layer layout); every group's entries have the same size, so one pool
serves them all, and each entry's header names its group's layout. Which slot
holds what is decided by the scheduler half (`kvwire.media.cpu_pool._slot_table`);
this side only copies. Stores run on a background thread and complete
asynchronously; loads verify each slot's header (and, when its layout
checksums payloads, the checksum) before copying it into the cache. The CPU
pool medium's layouts carry no payload checksum: only kvwire writes this
memory, in this process, so a slot's header naming its block and layout is
what tells a reused or mixed-up slot; the peer medium, whose pool other
processes read while it may be rewritten, keeps the checksum.

Every copy job has a deadline (`transfer_timeout_s` from its start), so
that no wait of the forward pass's thread is unbounded: a load still running
then is abandoned and its blocks are load errors; a save still running then
is abandoned and counts failed. An abandoned job copies nothing more: each
chunk is copied under the job's lock after checking it was not abandoned. A
save abandoned or failed mid-way leaves slots whose headers do not name
their blocks (a chunk's headers are cleared before its payloads are
written), which a later load reports instead of copying.

A save may also be released (`CPUPoolTransferHandler.release_saves_reading`):
a block it reads was freed meanwhile (a sliding window moved on, a request
was preempted) and given to a request that writes it this step. A released
save copies nothing more and never commits: the scheduler half frees its
slots (`saves_released` counts its blocks).

A medium built on the pool (the tiered medium) holds one of these handlers
and joins its copies through two hooks given at construction: one run before
a save writes pool slots, one that fills a load's slots before they are
copied into the cache.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Sequence, Set

from kvwire.blocks.format import (
    BlockLayout,
    CorruptBlockError,
    headers_without_checksum,
    verify_entry,
    write_header,
)
from kvwire.blocks.paged_cache import (
    PagedKVCaches,
    cache_sized_chunks,
    copy_on_this_thread_only,
)
from kvwire.blocks.transfers import BlockTransfer
from kvwire.exceptions import JobAbandoned
from kvwire.interface.counters import Counters
from kvwire.interface.types import BlockHash
from kvwire.media.base import JobResult, TransferHandler, TransferJob, TransferKind
from kvwire.media.cpu_pool.pool_memory import PoolSlots
from kvwire.media.io_threads import IOThreads
from kvwire.media.jobs import JobLedger, JobPiece, part_of
from kvwire.media.rate_limited import RateLimitedWarning
from kvwire.media.shutdown import close_in_steps

logger = logging.getLogger(__name__)

# Smaller pieces are not worth a thread hand-off.
_MIN_BLOCKS_PER_PIECE = 4
# Entries copied per chunk without a payload checksum: 16 MiB is 3-4 ms of
# one thread's copy, what a release of the save may wait.
_HEADER_ONLY_CHUNK_BYTES = 16 * 1024 * 1024


SlotsFilled = tuple[BlockTransfer, list[int]]
"""A load piece after its `fill_slots` hook: its blocks to copy from the pool, those failed."""


class CPUPoolTransferHandler(TransferHandler):
    """Owns the pool tensor; copies blocks between it and the paged caches off the forward pass.

    `layouts` and `caches` have one item per KV cache group: a transfer of
    group `g` reads or writes group `g`'s layers, with its block ids, and
    its entries carry group `g`'s layout in their headers.

    `before_writing_slots(slots, deadline)` runs on a copy thread before a
    save writes `slots` (the piece's deadline): a medium built on the pool
    waits there for its own users of them; raising fails the save's blocks.
    `fill_slots(piece)` runs on a load thread before a load piece is
    verified and copied: it may bring blocks into their slots from elsewhere,
    and returns the piece's blocks to copy from the pool and the block ids
    already failed (`SlotsFilled`), or None once the piece was given up on.
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
        before_writing_slots: Callable[[Sequence[int], float], None] | None = None,
        fill_slots: Callable[[JobPiece], SlotsFilled | None] | None = None,
    ) -> None:
        if not layouts or len(layouts) != len(caches):
            raise ValueError(
                f"CPUPoolTransferHandler: got {len(layouts)} layouts and {len(caches)} caches; "
                "expected one of each per KV cache group (at least one)"
            )
        self._layouts = tuple(layouts)
        self._caches = tuple(caches)
        # Every group's entries have the size of the first's (cache_groups checks it).
        self._layout = self._layouts[0]
        self.pool = PoolSlots(self._layout, num_slots)
        self._counters = counters
        self._io_threads = io_threads
        self._before_writing_slots = before_writing_slots
        self._fill_slots = fill_slots
        self._warn = RateLimitedWarning(logger)
        self._save_pool = IOThreads(io_threads, "kvwire-cpu-save", copy_on_this_thread_only)
        self._load_pool = IOThreads(io_threads, "kvwire-cpu-load", copy_on_this_thread_only)
        self._jobs: JobLedger[JobPiece] = JobLedger(
            counters=counters,
            warn=self._warn,
            label="CPU offload: ",
            transfer_timeout_s=transfer_timeout_s,
        )

    def submit(self, job: TransferJob) -> None:
        """Start copying the job's blocks, into their pool slots or out of them into the cache."""
        deadline = self._jobs.begin(job)
        save = job.kind is TransferKind.SAVE
        threads, work = (self._save_pool, self._save) if save else (self._load_pool, self._load)
        for transfer in job.transfers:
            for piece in self._split(transfer):
                self._jobs.start(JobPiece(job.job_id, (piece,), deadline), threads, work)
        self._jobs.submitted(job.job_id)

    def poll(self) -> list[JobResult]:
        """The jobs ended since the last call; those past their deadline are given up on first."""
        return self._jobs.poll()

    def wait(self, job_ids: Iterable[int], until: float | None = None) -> bool:
        """Block until these jobs ended (past its deadline, a job is given up on), or `until`."""
        return self._jobs.wait(job_ids, until)

    def release_saves_reading(
        self, request_ids: Iterable[str], block_ids: Set[int]
    ) -> list[BlockTransfer]:
        """Release the saves reading any of `block_ids`; wait out `request_ids`' transfers.

        Called at the start of a step, before anything writes: `block_ids`
        were just given to requests, and may have been freed while a save
        still read them; `request_ids` were preempted, and their blocks are
        about to be reused. Returns the pieces released (their slots must
        never be published). The saves of `request_ids` are not released
        but waited for, each at most until its deadline: one still running
        then is given up on and counts failed. (The connector waits out the
        requests' loads itself.)
        """
        # The flag is set before anything can write the blocks, and a chunk is
        # copied only under the piece's lock with it unset: every byte copied
        # was read before the flag was set, and nothing is copied after.
        released = [
            transfer
            for piece in self._jobs.release_saves_reading((), block_ids)
            for transfer in piece.transfers
        ]
        if released:
            self._counters.add("saves_released", sum(len(piece.block_ids) for piece in released))
        if request_ids:  # most steps preempt nothing: nothing to build then
            self._jobs.wait(self._jobs.save_jobs_of(request_ids))
        return released

    def _split(self, transfer: BlockTransfer) -> list[BlockTransfer]:
        """Up to one piece per thread, so a large transfer uses every copy thread."""
        count = len(transfer.block_ids)
        pieces = max(1, min(self._io_threads, count // _MIN_BLOCKS_PER_PIECE))
        bounds = [count * i // pieces for i in range(pieces + 1)]
        return [part_of(transfer, start, end) for start, end in itertools.pairwise(bounds)]

    def _save(self, job: JobPiece) -> None:
        (transfer,) = job.transfers
        caches = self._caches[transfer.group]
        layout = self._layouts[transfer.group]
        started = time.perf_counter()
        stored = 0
        try:
            if self._before_writing_slots is not None:
                self._before_writing_slots(transfer.slots, job.deadline)
            # Chunk by chunk, so each checksum (where the layout has one) reads
            # entries the copy has just written while they are still in the CPU
            # cache; under the job's lock, so that once abandoned it reads no
            # block the engine reuses.
            for chunk in _chunks(len(transfer.slots), layout):
                slots = transfer.slots[chunk.start : chunk.stop]
                with job.lock:
                    job.check()
                    # A slot whose payload stops half-written names no block.
                    self.pool.clear_headers(slots)
                    caches.gather_many(
                        transfer.block_ids[chunk.start : chunk.stop], slots, self.pool.payloads
                    )
                    hashes = transfer.block_hashes[chunk.start : chunk.stop]
                    self._write_headers(layout, slots, hashes)
                    stored += len(slots)
        except JobAbandoned:
            # Counted failed when given up on; counted when released, and the
            # scheduler half frees its slots, whatever they hold.
            pass
        except Exception:
            # The slots keep whatever they had; their headers no longer match,
            # so a later load reports them instead of copying them.
            logger.exception("CPU offload: save of request %r failed", transfer.request_id)
        if job.end():
            # Counted before the piece settles, so whoever waits for it sees them.
            self._jobs.count_save(job, stored, self._layout.payload_bytes, started)

    # --------------------------------------------------------------- loads

    def _load(self, job: JobPiece) -> None:
        """Verify and copy one piece into the cache; its failed block ids go to `job.failed`."""
        (transfer,) = job.transfers
        started = time.perf_counter()
        failed: list[int] = []
        if self._fill_slots is not None:
            filled = self._fill_slots(job)
            if filled is None:
                return  # its caller has reported every block of it failed
            transfer, failed = filled
        copy_failed = self._copy_into_cache(job, transfer)
        if copy_failed is None:
            return  # its caller has reported every block of it failed
        job.failed = failed + copy_failed
        if job.end():
            loaded = len(job.block_ids) - len(job.failed)
            self._jobs.count_load(job, loaded, self._layout.payload_bytes, started)

    def _copy_into_cache(self, job: JobPiece, transfer: BlockTransfer) -> list[int] | None:
        """Verify `transfer`'s slots and copy them into the cache; the block ids that failed.

        None once `job` was given up on (nothing more is written then).
        """
        caches = self._caches[transfer.group]
        layout = self._layouts[transfer.group]
        failed: list[int] = []
        try:
            # Chunk by chunk, so the copy into the cache reads entries that
            # verification has just read, while they are still in the CPU cache.
            for chunk in _chunks(len(transfer.slots), layout):
                verified_ids, verified_slots, failed_here = self._verify(
                    layout,
                    caches,
                    transfer.block_ids[chunk.start : chunk.stop],
                    transfer.slots[chunk.start : chunk.stop],
                    transfer.block_hashes[chunk.start : chunk.stop],
                )
                failed += failed_here
                # Only verified entries reach the cache, and only while the
                # caller still waits for them.
                with job.lock:
                    job.check()
                    caches.scatter_many(self.pool.payloads, verified_slots, verified_ids)
        except JobAbandoned:
            return None
        except Exception:
            # Never an exception into the engine: the whole transfer is reported failed.
            logger.exception("CPU offload: load of request %r failed", transfer.request_id)
            failed = list(transfer.block_ids)
        return failed

    @property
    def layouts(self) -> tuple[BlockLayout, ...]:
        """Each KV cache group's layout, as the pool's entries carry it."""
        return self._layouts

    def name_slots(
        self, group: int, slots: Sequence[int], block_hashes: Sequence[BlockHash]
    ) -> None:
        """Name each slot's block of `group`, its payload written elsewhere (by a tier's load)."""
        self._write_headers(self._layouts[group], slots, block_hashes)

    def _write_headers(
        self, layout: BlockLayout, slots: Sequence[int], block_hashes: Sequence[BlockHash]
    ) -> None:
        """Name each slot's block, its payload already written (checksummed where the layout is)."""
        if layout.payload_checksum:
            for slot, block_hash in zip(slots, block_hashes, strict=True):
                write_header(self.pool.entry(slot), layout, block_hash)
        else:
            self.pool.set_headers(slots, headers_without_checksum(layout, block_hashes))

    def _verify(
        self,
        layout: BlockLayout,
        caches: PagedKVCaches,
        block_ids: Sequence[int],
        slots: Sequence[int],
        block_hashes: Sequence[BlockHash],
    ) -> tuple[list[int], list[int], list[int]]:
        """(block ids, slots) of the entries fit to load, and the block ids that are not."""
        if (
            not layout.payload_checksum
            and caches.holds_block_ids(block_ids)
            and self.pool.headers(slots) == headers_without_checksum(layout, block_hashes)
        ):
            # Every header is what the save wrote for its block: one comparison.
            return list(block_ids), list(slots), []
        verified_ids: list[int] = []
        verified_slots: list[int] = []
        failed: list[int] = []
        for block_id, slot, block_hash in zip(block_ids, slots, block_hashes, strict=True):
            try:
                verify_entry(self.pool.entry(slot), layout, block_hash)
                caches.check_block_id(block_id)
            except (CorruptBlockError, IndexError) as error:
                self._warn.warn("corrupt", "CPU offload: not loading slot %d: %s", slot, error)
                self._counters.add("corrupt_entries")
                failed.append(block_id)
                continue
            verified_ids.append(block_id)
            verified_slots.append(slot)
        return verified_ids, verified_slots, failed

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish the copies in flight (up to `timeout_s`), then stop the threads.

        Every step runs even when one fails (logged).
        """
        deadline = time.monotonic() + timeout_s
        steps: list[tuple[str, Callable[[], object]]] = [
            ("ending transfers", lambda: self._end_all(deadline, timeout_s)),
            ("stopping the save threads", self._save_pool.shutdown),
            ("stopping the load threads", self._load_pool.shutdown),
        ]
        close_in_steps(logger, "CPU offload: ", steps)

    def _end_all(self, deadline: float, timeout_s: float) -> None:
        if not self._jobs.end_all(deadline):
            logger.warning(
                "CPU offload: transfers still running after %.0f s at shutdown", timeout_s
            )


def _chunks(count: int, layout: BlockLayout) -> list[range]:
    """Consecutive ranges of a transfer's entries, each copied under the job's lock.

    Cache-sized where payloads are checksummed (the checksum reads what the
    copy just wrote); larger without: a chunk then costs a few calls whatever
    its size, and its size only bounds how long a release waits for it.
    """
    if layout.payload_checksum:
        return cache_sized_chunks(count, layout.entry_bytes)
    return cache_sized_chunks(count, layout.entry_bytes, _HEADER_ONLY_CHUNK_BYTES)
