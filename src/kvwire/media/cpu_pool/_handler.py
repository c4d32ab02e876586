"""The CPU pool medium's worker side: the pool memory and the copies.

The pool is allocated once: ``num_slots`` entries, each a ``block_format``
header followed by one block of every layer of one KV cache group
(cross-layer layout); every group's entries have the same size, so one pool
serves them all, and each entry's header names its group's layout. Which slot
holds what is decided by the scheduler side (:mod:`kvwire.media.cpu_pool._slot_table`);
this side only copies. Stores run on a background thread and complete
asynchronously; loads verify each slot's header (and, when its layout
checksums payloads, the checksum) before copying it into the cache. The CPU
pool medium's layouts carry no payload checksum: only kvwire writes this
memory, in this process, so a slot's header naming its block and layout is
what tells a reused or mixed-up slot; the peer medium, whose pool other
processes read while it may be rewritten, keeps the checksum.

Every copy job has a deadline (``transfer_timeout_s`` from its start), so
that no wait of the forward pass's thread is unbounded: a load still running
then is abandoned and its blocks are load errors; a store still running then
is abandoned and counts failed. An abandoned job copies nothing more: each
chunk is copied under the job's lock after checking it was not abandoned. A
store abandoned or failed mid-way leaves slots whose headers do not name
their blocks (a chunk's headers are cleared before its payloads are
written), which a later load reports instead of copying.

A store may also be released (:meth:`CPUPoolTransferHandler.release_saves_reading`):
a block it reads was freed meanwhile (a sliding window moved on, a request
was preempted) and given to a request that writes it this step. A released
store copies nothing more and never commits: the scheduler side frees its
slots (``saves_released`` counts its blocks).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence, Set

import attrs

from kvwire.blocks.format import (
    HEADER_SIZE,
    BlockLayout,
    CorruptBlockError,
    verify_entry,
    write_header,
)
from kvwire.blocks.paged_cache import (
    PagedKVCaches,
    cache_sized_chunks,
    copy_on_this_thread_only,
)
from kvwire.blocks.transfers import BlockTransfer
from kvwire.interface.counters import Counters
from kvwire.media._job_threads import JobThreads
from kvwire.media._load_ledger import AsyncLoad, LedgerLoadCalls, LoadLedger
from kvwire.media._rate_limited import RateLimitedWarning
from kvwire.media._shutdown import close_in_steps
from kvwire.media._transfer_jobs import BlockJob, JobAbandoned
from kvwire.media.base import TransferHandler
from kvwire.media.cpu_pool._pool_memory import PoolSlots

logger = logging.getLogger(__name__)

# Smaller pieces are not worth a thread hand-off.
_MIN_BLOCKS_PER_PIECE = 4
# What a slot's header holds while its payload is being written: no block.
_NO_HEADER = bytes(HEADER_SIZE)


class _PoolJob(BlockJob):
    """One piece of a transfer, copied by one thread; ``async_load`` is its request's load."""

    def __init__(
        self,
        piece: BlockTransfer,
        deadline: float,
        *,
        is_store: bool,
        async_load: AsyncLoad[_PoolJob] | None = None,
    ) -> None:
        super().__init__(deadline, piece.block_ids)
        self.piece = piece
        self.is_store = is_store
        self.async_load = async_load
        self.released = False

    def release(self) -> bool:
        """Drop this store: it copies nothing more and never commits.

        False if it ended, or was given up on, first. Waits at most for the
        chunk being copied under :attr:`lock` (a memory copy).
        """
        with self.lock:
            if self.ended or self.abandoned or self.released:
                return False
            self.released = True
            return True


class CPUPoolTransferHandler(LedgerLoadCalls, TransferHandler):
    """Owns the pool tensor; copies blocks between it and the paged caches off the forward pass.

    ``layouts`` and ``caches`` have one item per KV cache group: a transfer of
    group ``g`` reads or writes group ``g``'s layers, with its block ids, and
    its entries carry group ``g``'s layout in their headers.
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
        self._transfer_timeout_s = transfer_timeout_s
        self._warn = RateLimitedWarning(logger)
        self._store_pool = JobThreads(io_threads, "kvwire-cpu-store", copy_on_this_thread_only)
        self._load_pool = JobThreads(io_threads, "kvwire-cpu-load", copy_on_this_thread_only)
        self._changed = threading.Condition()
        # Stores still reading each request's blocks.
        self._jobs_per_request: dict[str, set[_PoolJob]] = {}
        self._loads: LoadLedger[_PoolJob] = LoadLedger(
            counters=counters,
            warn=self._warn,
            label="CPU offload: ",
            transfer_timeout_s=transfer_timeout_s,
        )

    # --------------------------------------------------- per-request stores

    def _job_started(self, job: _PoolJob) -> None:
        with self._changed:
            self._jobs_per_request.setdefault(job.piece.request_id, set()).add(job)

    def _forget_job(self, job: _PoolJob) -> None:
        with self._changed:
            request_id = job.piece.request_id
            jobs = self._jobs_per_request.get(request_id)
            if jobs is not None:
                jobs.discard(job)
                if not jobs:
                    del self._jobs_per_request[request_id]
            self._changed.notify_all()

    def is_busy(self, request_id: str) -> bool:
        """Whether a store or asynchronous load of ``request_id`` is still running.

        Its stores past their deadline are given up on first.
        """
        if self._loads.is_loading(request_id):
            return True
        now = time.monotonic()
        with self._changed:
            jobs = self._jobs_per_request.get(request_id)
            if not jobs:
                return False
            overdue = [job for job in jobs if job.is_store and job.deadline <= now]
            if not overdue:
                return True
        # Outside the lock: giving up on a job waits for its copy under way.
        self._give_up(overdue)
        with self._changed:
            return request_id in self._jobs_per_request

    def _wait_for_requests(self, request_ids: Iterable[str]) -> None:
        """Block until no transfer of these requests runs (their blocks are about to be reused).

        At most until their deadlines: a transfer still running then is given
        up on, and copies nothing more to or from the blocks (an asynchronous
        load is then reported finished, its blocks failed).
        """
        wanted = set(request_ids)
        self._loads.wait_out(wanted)

        def running() -> list[_PoolJob]:
            with self._changed:
                return [job for rid in wanted for job in self._jobs_per_request.get(rid, ())]

        jobs = running()
        if not jobs:
            return
        until = max(job.deadline for job in jobs)
        with self._changed:
            self._changed.wait_for(
                lambda: not wanted & self._jobs_per_request.keys(),
                max(0.0, until - time.monotonic()),
            )
        self._give_up(running())

    def wait_for_saves(self, timeout_s: float | None = None) -> bool:
        """Block until every store ended or ran past its deadline.

        False if ``timeout_s`` ran out first; without it, it still ends, at
        the latest when the last job's own deadline passes.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with self._changed:
                jobs = [job for jobs in self._jobs_per_request.values() for job in jobs]
            now = time.monotonic()
            overdue = [job for job in jobs if job.deadline <= now]
            if overdue:
                self._give_up(overdue)
                continue
            if not jobs:
                return True
            if deadline is not None and now >= deadline:
                return False
            wake = min(job.deadline for job in jobs)
            if deadline is not None:
                wake = min(wake, deadline)
            with self._changed:
                self._changed.wait_for(
                    lambda: not self._jobs_per_request, max(0.0, wake - time.monotonic())
                )

    def _give_up(self, jobs: Iterable[_PoolJob]) -> None:
        """Stop waiting for the stores ``jobs``: they count failed."""
        for job in jobs:
            if job.abandon():
                if job.released:  # counted when released
                    self._forget_job(job)
                    continue
                blocks = len(job.piece.block_ids)
                self._counters.add_many({"save_errors": blocks, "save_timeouts": blocks})
                self._warn.warn(
                    "store-timeout",
                    "CPU offload: a store of %d blocks still running after %g s "
                    "(transfer_timeout_s) is counted failed",
                    blocks,
                    self._transfer_timeout_s,
                )
                self._forget_job(job)

    # -------------------------------------------------------------- stores

    def save(self, saves: Sequence[BlockTransfer]) -> None:
        """Start copying blocks into their pool slots; completion shows in :meth:`is_busy`."""
        deadline = time.monotonic() + self._transfer_timeout_s
        for transfer in saves:
            for piece in self._split(transfer):
                job = _PoolJob(piece, deadline, is_store=True)
                self._job_started(job)
                job.future = self._store_pool.submit(self._store, job)

    def release_saves_reading(
        self, request_ids: Iterable[str], block_ids: Set[int]
    ) -> list[BlockTransfer]:
        """Release the stores reading any of ``block_ids``; wait out ``request_ids``' transfers.

        Called at the start of a step, before anything writes: ``block_ids``
        were just given to requests, and may have been freed while a store
        still read them; ``request_ids`` were preempted, and their blocks are
        about to be reused. Returns the pieces released (their slots must
        never be published). The stores of ``request_ids`` are not released
        but waited for, each at most until its deadline: one still running
        then is given up on and counts failed.
        """
        released = self._release_stores_reading(block_ids)
        if request_ids:  # most steps preempt nothing: nothing to build then
            self._wait_for_requests(request_ids)
        return released

    def _release_stores_reading(self, block_ids: Set[int]) -> list[BlockTransfer]:
        """Release the stores in flight that read any of ``block_ids``; the pieces released.

        No waiting beyond a chunk's copy under way.
        """
        if not block_ids:
            return []
        with self._changed:
            reading = [
                job
                for jobs in self._jobs_per_request.values()
                for job in jobs
                if job.is_store and not block_ids.isdisjoint(job.piece.block_ids)
            ]
        # The flag is set before anything can write the blocks, and a chunk is
        # copied only under the job's lock with it unset: every byte copied
        # was read before the flag was set, and nothing is copied after.
        released = [job.piece for job in reading if job.release()]
        if released:
            self._counters.add("saves_released", sum(len(piece.block_ids) for piece in released))
        return released

    def _split(self, transfer: BlockTransfer) -> list[BlockTransfer]:
        """Up to one piece per thread, so a large transfer uses every copy thread."""
        count = len(transfer.block_ids)
        pieces = max(1, min(self._io_threads, count // _MIN_BLOCKS_PER_PIECE))
        bounds = [count * i // pieces for i in range(pieces + 1)]
        return [
            attrs.evolve(
                transfer,
                block_ids=transfer.block_ids[start:end],
                slots=transfer.slots[start:end],
                block_hashes=transfer.block_hashes[start:end],
            )
            for start, end in itertools.pairwise(bounds)
        ]

    def _store(self, job: _PoolJob) -> None:
        transfer = job.piece
        caches = self._caches[transfer.group]
        layout = self._layouts[transfer.group]
        started = time.perf_counter()
        stored = 0
        try:
            # Chunk by chunk, so each checksum (where the layout has one) reads
            # entries the copy has just written while they are still in the CPU
            # cache; under the job's lock, so that once abandoned it reads no
            # block the engine reuses.
            for chunk in cache_sized_chunks(len(transfer.slots), self._layout.entry_bytes):
                slots = transfer.slots[chunk.start : chunk.stop]
                with job.lock:
                    job.check()
                    if job.released:
                        break
                    # A slot whose payload stops half-written names no block.
                    for slot in slots:
                        self.pool.entry(slot)[:HEADER_SIZE] = _NO_HEADER
                    caches.gather_many(
                        transfer.block_ids[chunk.start : chunk.stop], slots, self.pool.payloads
                    )
                    for slot, block_hash in zip(
                        slots, transfer.block_hashes[chunk.start : chunk.stop], strict=True
                    ):
                        write_header(self.pool.entry(slot), layout, block_hash)
                        stored += 1
        except JobAbandoned:
            pass  # counted failed when it was given up on
        except Exception:
            # The slots keep whatever they had; their headers no longer match,
            # so a later load reports them instead of copying them.
            logger.exception("CPU offload: store of request %r failed", transfer.request_id)
        if not job.end():
            return
        if job.released:
            # Final once ended. Counted when released; the scheduler side frees
            # its slots, whatever they hold, so it never commits.
            self._forget_job(job)
            return
        # Counted before the job is forgotten, so whoever waits for it sees them.
        self._counters.add_many(
            {
                "blocks_saved": stored,
                "bytes_saved": stored * self._layout.payload_bytes,
                "save_errors": len(transfer.block_ids) - stored,
                "save_seconds": time.perf_counter() - started,
            }
        )
        self._forget_job(job)

    # --------------------------------------------------------------- loads

    def start_loads(
        self, loads: Sequence[BlockTransfer], async_loads: Sequence[BlockTransfer]
    ) -> None:
        """Start verifying and copying pool slots into the cache; ``loads`` end within the step."""
        deadline = time.monotonic() + self._transfer_timeout_s
        for transfer in loads:
            for piece in self._split(transfer):
                job = _PoolJob(piece, deadline, is_store=False)
                self._loads.add_sync(job)
                job.future = self._load_pool.submit(self._load, job)
        # A request loads in several groups at once: one load per request,
        # finished when the pieces of all its transfers are.
        states: dict[str, AsyncLoad[_PoolJob]] = {}
        for transfer in async_loads:
            state = states.get(transfer.request_id)
            if state is None:
                state = states[transfer.request_id] = self._loads.begin_async(
                    transfer.request_id, deadline
                )
            for piece in self._split(transfer):
                job = _PoolJob(piece, deadline, is_store=False, async_load=state)
                self._loads.add_async(state, job)
                job.future = self._load_pool.submit(self._load_async, job)
        for state in states.values():
            self._loads.submitted(state)

    def _load_async(self, job: _PoolJob) -> None:
        self._load(job)
        if job.ended:  # not given up on at its deadline (reported then)
            assert job.async_load is not None
            self._loads.job_ended(job.async_load, job)

    def _load(self, job: _PoolJob) -> None:
        """Verify and copy one piece into the cache; its failed block ids go to ``job.failed``."""
        transfer = job.piece
        caches = self._caches[transfer.group]
        layout = self._layouts[transfer.group]
        started = time.perf_counter()
        failed: list[int] = []
        try:
            # Chunk by chunk, so the copy into the cache reads entries that
            # verification has just read, while they are still in the CPU cache.
            for chunk in cache_sized_chunks(len(transfer.slots), self._layout.entry_bytes):
                verified_ids: list[int] = []
                verified_slots: list[int] = []
                for block_id, slot, block_hash in zip(
                    transfer.block_ids[chunk.start : chunk.stop],
                    transfer.slots[chunk.start : chunk.stop],
                    transfer.block_hashes[chunk.start : chunk.stop],
                    strict=True,
                ):
                    try:
                        verify_entry(self.pool.entry(slot), layout, block_hash)
                        caches.check_block_id(block_id)
                    except (CorruptBlockError, IndexError) as error:
                        self._warn.warn(
                            "corrupt", "CPU offload: not loading slot %d: %s", slot, error
                        )
                        self._counters.add("corrupt_entries")
                        failed.append(block_id)
                        continue
                    verified_ids.append(block_id)
                    verified_slots.append(slot)
                # Only verified entries reach the cache, and only while the
                # caller still waits for them.
                with job.lock:
                    job.check()
                    caches.scatter_many(self.pool.payloads, verified_slots, verified_ids)
        except JobAbandoned:
            return  # its caller has reported every block of it failed
        except Exception:
            # Never an exception into the engine: the whole transfer is reported failed.
            logger.exception("CPU offload: load of request %r failed", transfer.request_id)
            failed = list(transfer.block_ids)
        job.failed = failed
        if not job.end():
            return
        loaded = len(transfer.block_ids) - len(failed)
        self._loads.count_ended(job, loaded, self._layout.payload_bytes, started)

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish the copies in flight (up to ``timeout_s``), then stop the threads.

        Every step runs even when one fails (logged).
        """
        deadline = time.monotonic() + timeout_s
        steps: list[tuple[str, Callable[[], object]]] = [
            ("waiting for loads", self.wait_for_loads),
            ("waiting for transfers", lambda: self._wait_at_close(timeout_s)),
            ("ending loads", lambda: self._loads.end_async(deadline)),
            ("stopping the store threads", self._store_pool.shutdown),
            ("stopping the load threads", self._load_pool.shutdown),
        ]
        close_in_steps(logger, "CPU offload: ", steps)

    def _wait_at_close(self, timeout_s: float) -> None:
        if not self.wait_for_saves(timeout_s):
            logger.warning(
                "CPU offload: transfers still running after %.0f s at shutdown", timeout_s
            )
        with self._changed:
            jobs = [job for jobs in self._jobs_per_request.values() for job in jobs]
        self._give_up(jobs)
