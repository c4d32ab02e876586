"""The worker half of a store medium: it moves bytes, nothing else.

`StoreTransferHandler`, the `kvwire.media.TransferHandler` of
every store medium (`kvwire.media.StoreMedium`),
moves blocks straight between the KV cache and the `kvwire.media.BlockStore`, on
background threads: a load reads each entry's payload into the block's
ranges in the cache (`kvwire.media.BlockStore.read_into_ranges`; see
`kvwire.blocks.memory`), a save writes the entry from them
(`kvwire.media.BlockStore.write_ranges`). There is no staging copy, and
the forward pass's thread only submits jobs. Loads and saves have separate thread pools, so a
backlog of saves never delays a load the forward pass is waiting for.

Integrity: a loaded entry's header, checksum (and MAC) are verified over the
bytes where they landed, in the cache, and only a block that passes is
counted loaded; one that fails is a load error (reported by id, never
raised), its cache block holds garbage the engine never uses: it computes the
block again. A save checksums (and seals) the block's ranges just before
writing them, a cache-sized chunk at a time, while they are still in the CPU
cache.

The blocks a save reads must not change until it has written them. The
connector keeps them: a finished request whose saves run keeps its blocks
until `StoreTransferHandler.poll` reports its save job ended (it is
then finished sending), and before each forward pass
`StoreTransferHandler.release_saves_reading` releases the saves of preempted
requests and of blocks given to a request since the last step (the engine
frees a block without telling the connector when a sliding window moves on
or a request is preempted, and may give it out again at once): one not
started is cancelled, one under way is given up on (`saves_released`
counts their blocks). A save given up on, released or past its deadline,
closes its gate: the store commits none of its entries whose bytes had not
all left the cache by then (a file is not renamed into place, a `SET` is
never completed; see `kvwire.media.BlockStore.write_ranges`), so no entry
is ever made of bytes being overwritten, and one another engine stored under the same hash stays.

Every transfer has a deadline (`transfer_timeout_s` from its start): a
load still running past it is given up on and its blocks are load errors; a
save still running past it is given up on and counted failed. Once a load is
given up on, nothing writes into its cache blocks: every write into them goes
through the job's `kvwire.media.CacheWrites` gate, which
then refuses new writes; a write already in a syscall cannot be cancelled,
so the waiter waits for it (`late_write_grace_s`) and, should it not
return, raises `kvwire.media.LateWriteError`: the engine
stops rather than risk wrong KV. A save given up on computes no further
checksum and commits no further entry: the gate covers both.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TypeGuard, TypeVar, cast

from kvwire.blocks.format import (
    HEADER_SIZE,
    BlockLayout,
    CorruptBlockError,
    encode_header,
    verify_parts,
)
from kvwire.blocks.memory import BlockMemory
from kvwire.blocks.paged_cache import cache_sized_chunks
from kvwire.blocks.transfers import BlockTransfer
from kvwire.common.plugin_calls import plugin_message
from kvwire.common.redaction import shown
from kvwire.exceptions import JobAbandoned, KVWireError
from kvwire.interface.counters import Counters
from kvwire.interface.types import BlockHash, BlockRemoved, BlockStored, KVCacheEvent
from kvwire.media.base import JobResult, TransferHandler, TransferJob, TransferKind
from kvwire.media.io_threads import IOThreads
from kvwire.media.jobs import JobLedger, JobPiece, part_of
from kvwire.media.rate_limited import RateLimitedWarning
from kvwire.media.shutdown import close_in_steps
from kvwire.media.store._entry_keys import EntryKeys, LayoutKeys
from kvwire.media.store.base import (
    LATE_WRITE_GRACE_S,
    BlockStore,
    CacheWrites,
    LateWriteError,
    StoreReplyError,
    checked_write_results,
)

logger = logging.getLogger(__name__)

_Answer = TypeVar("_Answer")
# What the store's iterator gives once it has no more answers.
_NO_MORE = object()


class _StoreCallFailed(KVWireError, RuntimeError):
    """A call into the store raised, or answered other than one result per key.

    The store's failure, not kvwire's: its transfer fails (load errors, or
    blocks not stored) with a one-line warning that names the call and shows
    the store's message redacted, and the engine carries on.
    """


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


class _StorePiece(JobPiece):
    """A load run or a save batch: blocks of one transfer, and the gate on their cache ranges."""

    def __init__(
        self, job_id: int, transfer: BlockTransfer, deadline: float, save_bytes: int = 0
    ) -> None:
        super().__init__(job_id, (transfer,), deadline)
        self.transfer = transfer
        self.group = transfer.group
        self.hashes = transfer.block_hashes
        self.cache_access = CacheWrites()
        # What a save batch's entries count towards `max_save_bytes` until it settles.
        self.save_bytes = save_bytes


class _Headers(threading.local):
    """Each I/O thread's header buffers, reused from job to job (grown when a job needs more)."""

    def __init__(self) -> None:
        self._memory = bytearray()

    def views(self, count: int) -> list[memoryview]:
        if len(self._memory) < count * HEADER_SIZE:
            self._memory = bytearray(count * HEADER_SIZE)
        whole = memoryview(self._memory)
        return [whole[i * HEADER_SIZE : (i + 1) * HEADER_SIZE] for i in range(count)]


class StoreTransferHandler(TransferHandler):
    """Saves and loads blocks of the registered caches through a store, off the forward pass.

    It serves every KV cache group of the engine: `layouts` and `memories`
    hold one layout and one `BlockMemory` per group, in group order (a
    single-group engine passes one of each). A transfer names its group
    (`kvwire.media.BlockTransfer.group`); its blocks are read from or written
    to that group's layers only, and its entries are headed, checked and keyed with that group's
    layout, so an entry of one group never loads into another.

    `keys` names a block's entry in the store and tells which block and KV
    cache group a key names (the medium's choice; by default each group
    layout's keys, `LayoutKeys`), and
    `medium` names the store in the KV cache events (`take_events`). Saves in flight hold
    at most `max_save_bytes` of entries: past that, a save is dropped and
    counted (`saves_dropped`), never waited for. A transfer still running
    `transfer_timeout_s` after it started is given up on (see the module).

    `store_counters` returns the store's own counts since its last call
    (`take_counters` reports them); `on_close` runs last in
    `close`, once the transfers ended and the threads stopped: a
    medium closes its store there. Without it the store stays open (it is
    the caller's).
    """

    def __init__(
        self,
        *,
        store: BlockStore,
        layouts: Sequence[BlockLayout],
        memories: Sequence[BlockMemory],
        io_threads: int,
        batch_blocks: int,
        counters: Counters,
        medium: str,
        max_save_bytes: int,
        keys: EntryKeys | None = None,
        transfer_timeout_s: float = 30.0,
        late_write_grace_s: float = LATE_WRITE_GRACE_S,
        store_counters: Callable[[], Mapping[str, float]] | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        if not layouts or len(layouts) != len(memories):
            raise ValueError(
                f"StoreTransferHandler: got {len(layouts)} layouts and {len(memories)} block "
                "memories; expected one of each per KV cache group (at least one)"
            )
        self._store = store
        self._late_write_grace_s = late_write_grace_s
        # Per group, built once: the hot path only indexes them.
        self._layouts = tuple(layouts)
        self._memories = tuple(memories)
        self._batch_blocks = batch_blocks
        self._max_save_bytes = max_save_bytes
        # More runs of one transfer than cores only contend for the GIL
        # (`--only redis`, docs/performance.md); other threads serve other transfers.
        self._runs_per_transfer = max(1, min(io_threads, usable_cores()))
        self._counters = counters
        self._keys = keys if keys is not None else LayoutKeys(self._layouts)
        self._medium = medium
        self._store_counters = store_counters
        self._on_close = on_close
        self._load_pool = IOThreads(io_threads, "kvwire-load")
        self._save_pool = IOThreads(io_threads, "kvwire-save")
        self._headers = _Headers()
        self._warn = RateLimitedWarning(logger)
        self._lock = threading.Lock()
        self._jobs: JobLedger[_StorePiece] = JobLedger(
            counters=counters,
            warn=self._warn,
            label="",
            transfer_timeout_s=transfer_timeout_s,
            # A read already in a system call: waited for, up to the grace
            # period; a checksum under way reads the cache: only once it is
            # done may the blocks change (CPU work, never I/O: a short wait).
            after_abandon=lambda piece: piece.cache_access.close(self._late_write_grace_s),
            on_settled=self._settled,
        )
        # Bytes of the entries of the save batches not settled yet: running,
        # queued, or given up on while a checksum of theirs may still read the cache.
        self._save_bytes_in_flight = 0
        self._events: list[KVCacheEvent] = []

    def idle(self) -> bool:
        """Whether no job runs on any thread, jobs given up on included."""
        return self._jobs.idle()

    def _settled(self, piece: _StorePiece) -> None:
        if piece.save_bytes:
            with self._lock:
                self._save_bytes_in_flight -= piece.save_bytes

    # ----------------------------------------------------------------- loads

    def submit(self, job: TransferJob) -> None:
        """Submit the job's runs or batches to the load or save threads; returns at once."""
        if job.kind is TransferKind.SAVE:
            self._submit_saves(job)
            return
        deadline = self._jobs.begin(job)
        for transfer in job.transfers:
            self._submit_runs(job.job_id, transfer, deadline)
        self._jobs.submitted(job.job_id)

    def poll(self) -> list[JobResult]:
        """The jobs that ended since the last call; overdue ones are given up on first."""
        return self._jobs.poll()

    def wait(self, job_ids: Iterable[int], until: float | None = None) -> bool:
        """Block until these jobs ended (past its deadline, a job is given up on), or `until`."""
        return self._jobs.wait(job_ids, until)

    def _submit_runs(self, job_id: int, transfer: BlockTransfer, deadline: float) -> None:
        """Submit the transfer's runs: one piece, one `read_into_ranges` each.

        A store that reads ahead (a server sending the next entries while
        this thread verifies) does so across the whole run. A transfer is
        split between the I/O threads (no more ways than there are cores), in
        runs of at least `batch_blocks`.
        """
        count = len(transfer.block_ids)
        run_blocks = max(self._batch_blocks, -(-count // self._runs_per_transfer))
        for start in range(0, count, run_blocks):
            end = min(start + run_blocks, count)
            run = _StorePiece(job_id, part_of(transfer, start, end), deadline)
            self._jobs.start(run, self._load_pool, self._load)

    def _load(self, run: _StorePiece) -> None:
        """Read one run straight into its cache blocks, verifying each entry where it landed.

        Failed block ids go to `run.failed`.
        """
        started = time.perf_counter()
        failed: list[int] = []
        corrupt: list[BlockHash] = []
        loaded = 0
        try:
            loaded = self._read_and_verify(run, failed, corrupt)
        except JobAbandoned:
            pass  # its caller has reported every block of it failed
        except Exception as error:
            # A store that raises fails the run, not the engine: warned in one
            # line. Anything else is kvwire's own bug, and keeps its traceback.
            if isinstance(error, _StoreCallFailed):
                self._warn.warn(
                    "load-raised",
                    "%s store: %s; its %d blocks are load errors, to be computed again",
                    self._medium,
                    error,
                    len(run.block_ids),
                )
            else:
                logger.exception("load of %d blocks failed", len(run.block_ids))
            failed = list(run.block_ids)
            loaded = 0
            # A thread of the store may still write into the blocks (a cluster's
            # fan-out): none may once the run is reported failed.
            try:
                run.cache_access.close(self._late_write_grace_s)
            except LateWriteError:
                # Not ended: its waiter gives up on it at its deadline, waits
                # for the write once more and stops the engine.
                logger.exception("a failed load is still writing into the KV cache")
                return
        if corrupt:
            # A corrupt entry would be a hit (and a failed load) for every later
            # request: drop it, so the next request that computes it saves it again.
            self._discard(run.group, corrupt)
        run.failed = failed
        if run.end():  # else given up on at its deadline: counted and reported then
            payload_bytes = self._layouts[run.group].payload_bytes
            self._jobs.count_load(run, loaded, payload_bytes, started)

    def _read_and_verify(
        self, run: _StorePiece, failed: list[int], corrupt: list[BlockHash]
    ) -> int:
        """Read the run's entries into header buffers and the blocks' ranges; blocks verified.

        Each entry is verified as soon as the store has read it, while it is
        still in the CPU cache (and, with a server, while the server sends
        the next). A block that fails stays garbage in the cache and is a
        load error: the engine computes it again.
        """
        memory = self._memories[run.group]
        layout = self._layouts[run.group]
        block_ids, hashes = [], []
        for block_id, block_hash in zip(run.block_ids, run.hashes, strict=True):
            if 0 <= block_id < memory.num_blocks:
                block_ids.append(block_id)
                hashes.append(block_hash)
            else:
                self._warn.warn(
                    "bad-block-id",
                    "not loading into block %d: outside the cache (0..%d)",
                    block_id,
                    memory.num_blocks - 1,
                )
                failed.append(block_id)
        headers = self._headers.views(len(block_ids))
        ranges_per_key = [
            [header, *memory.ranges(block_id)]
            for header, block_id in zip(headers, block_ids, strict=True)
        ]
        keys = [self._keys.key(run.group, block_hash) for block_hash in hashes]
        # Per key: None until the store reports it, then whether it verified.
        outcomes: list[bool | None] = [None] * len(keys)
        call = f"{type(self._store).__name__}.read_into_ranges"
        landed = self._store_call(
            call, lambda: self._store.read_into_ranges(keys, ranges_per_key, run.cache_access)
        )
        with contextlib.closing(landed):
            for index, size in self._answers(landed, call):
                if not self._is_new_report(index, size, outcomes):
                    continue
                block_hash = hashes[index]
                outcomes[index] = False
                if size is None:
                    continue
                try:
                    verify_parts(
                        headers[index], ranges_per_key[index][1:], size, layout, block_hash
                    )
                except CorruptBlockError as error:
                    self._warn.warn(
                        "corrupt", "not loading block %s: %s", block_hash.hex()[:16], error
                    )
                    self._counters.add("corrupt_entries")
                    corrupt.append(block_hash)
                    continue
                outcomes[index] = True
        unreported = outcomes.count(None)
        if unreported:
            # The store wrote what it liked into those blocks, or nothing: never loaded.
            self._warn.warn(
                "unreported",
                "%s store reported no result for %d of %d blocks it was asked to load: "
                "they are load errors, to be computed again",
                self._medium,
                unreported,
                len(keys),
            )
        failed.extend(block_id for block_id, ok in zip(block_ids, outcomes, strict=True) if not ok)
        return outcomes.count(True)

    @staticmethod
    def _store_call(call: str, action: Callable[[], _Answer]) -> _Answer:
        """`action()`, a call into the store; what it raises becomes `_StoreCallFailed`.

        `JobAbandoned` passes: the gate raises it to stop a store's writes.
        A `sys.exit()` inside the store is its failure too. Called once per
        entry read, so no signal bookkeeping (`kvwire.common.plugin_calls.contained_exits`):
        these threads take no signal, and on the main thread a
        `KeyboardInterrupt` is left to the program, as a Ctrl-C.
        """
        try:
            return action()
        except JobAbandoned:
            raise
        except StoreReplyError as error:
            raise _StoreCallFailed(str(error)) from None
        except Exception as error:
            raise _StoreCallFailed(f"{call} raised {plugin_message(error)}") from None
        except BaseException as error:
            on_main_thread = threading.current_thread() is threading.main_thread()
            if on_main_thread and isinstance(error, KeyboardInterrupt):
                raise
            raise _StoreCallFailed(f"{call} raised {plugin_message(error)}") from None

    def _answers(
        self, landed: Iterable[tuple[int, int | None]], call: str
    ) -> Iterator[tuple[int, int | None]]:
        """The store's `(index, size)` answers, as it yields them.

        What it raises is handled as in `_store_call`; an answer that is
        no pair fails the whole read.
        """
        answers = iter(landed)
        while True:
            answer: object = self._store_call(call, lambda: next(answers, _NO_MORE))
            if answer is _NO_MORE:
                return
            if not (isinstance(answer, tuple) and len(answer) == 2):
                raise _StoreCallFailed(
                    f"{call} yielded {shown(answer)}, not an (index, size or None) pair"
                )
            # What the pair holds is checked by _is_new_report.
            yield cast(tuple[int, int | None], answer)

    def _is_new_report(self, index: object, size: object, outcomes: list[bool | None]) -> bool:
        """Whether the store's `(index, size)` is the first answer for one of its keys.

        Anything else (no index of the call, a size that is no byte count, a
        second answer for a key, after which its block may hold other bytes
        than those verified) is a broken store: warned about, and the key,
        where there is one, fails.
        """
        if _is_count(index) and 0 <= index < len(outcomes):
            if outcomes[index] is None and (size is None or _is_count(size)):
                return True
            outcomes[index] = False
        self._warn.warn(
            "bad-report",
            "%s store answered (%s, %s) while reading %d entries, not (index, size or None) "
            "once per entry: not loading that block",
            self._medium,
            shown(index),
            shown(size),
            len(outcomes),
        )
        return False

    def _discard(self, group: int, hashes: list[BlockHash]) -> None:
        keys = [self._keys.key(group, block_hash) for block_hash in hashes]
        call = f"{type(self._store).__name__}.discard"
        try:
            self._store_call(call, functools.partial(self._store.discard, keys))
        except _StoreCallFailed as error:
            self._warn.warn(
                "discard-raised",
                "%s store: %s; %d corrupt entries stay (each fails its check again when read)",
                self._medium,
                error,
                len(keys),
            )
        self._record_events()

    # ---------------------------------------------------------------- events

    def take_events(self) -> list[KVCacheEvent]:
        """Blocks stored and removed since the last call, in the order this worker saw them."""
        with self._lock:
            events, self._events = self._events, []
        return events

    def _record_events(self, stored: Sequence[BlockHash] = (), group: int = 0) -> None:
        """Events after a store call: the blocks it stored, then the entries the store removed.

        A store reports only what it really removed: one without `discard`
        keeps a corrupt entry, and reports nothing. Keys of another layout (a
        shared medium) are no blocks of this engine. Each event names the KV
        cache group of its blocks (`stored` are `group`'s); removed
        entries are grouped by the group their key names.
        """
        with self._lock:
            if stored:
                self._events.append(BlockStored(tuple(stored), self._medium, group))
            # Under the same lock, after this write's blocks: an entry evicted
            # once written is reported removed after it was reported stored.
            removed: dict[int | None, list[BlockHash]] = {}
            for key in self._removed_keys():
                block = self._keys.block_of(key)
                if block is not None:
                    removed.setdefault(block[1], []).append(block[0])
            for removed_group, hashes in removed.items():
                self._events.append(BlockRemoved(tuple(hashes), self._medium, removed_group))

    def _removed_keys(self) -> list[str]:
        call = f"{type(self._store).__name__}.take_removed_keys"
        try:
            return self._store_call(call, lambda: list(self._store.take_removed_keys()))
        except _StoreCallFailed as error:
            self._warn.warn(
                "removed-keys-raised",
                "%s store: %s; the entries it removed are not reported in the KV cache events",
                self._medium,
                error,
            )
            return []

    # ----------------------------------------------------------------- saves

    def _submit_saves(self, job: TransferJob) -> None:
        """Submit the job's saves to the background threads, in batches; returns at once.

        Nothing is copied here: the saves read the cache blocks themselves,
        which the connector keeps unchanged until they end (see the module).
        When saves in flight already hold `max_save_bytes`, the blocks that
        do not fit are not saved (counted as `saves_dropped`), because a
        slow medium must not pin ever more blocks; the next request that
        computes them saves them again. A save still running
        `transfer_timeout_s` after it was submitted is counted failed
        (`save_timeouts`) and writes no more of its entries.
        """
        # Saves past their deadline hold no room any more.
        self._jobs.give_up_overdue(kind=TransferKind.SAVE)
        dropped = 0
        deadline = self._jobs.begin(job)
        for transfer in job.transfers:
            entry_bytes = self._layouts[transfer.group].entry_bytes
            with self._lock:
                room = (self._max_save_bytes - self._save_bytes_in_flight) // entry_bytes
                taken = max(0, min(len(transfer.block_ids), room))
                self._save_bytes_in_flight += taken * entry_bytes
            dropped += len(transfer.block_ids) - taken
            for start in range(0, taken, self._batch_blocks):
                end = min(start + self._batch_blocks, taken)
                batch = _StorePiece(
                    job.job_id,
                    part_of(transfer, start, end),
                    deadline,
                    save_bytes=(end - start) * entry_bytes,
                )
                self._jobs.start(batch, self._save_pool, self._save)
        self._jobs.submitted(job.job_id)
        if dropped:
            self._counters.add("saves_dropped", dropped)
            self._warn.warn(
                "saves-full",
                "saves in flight hold kv_connector_extra_config.max_save_bytes_in_flight: %d block "
                "saves dropped (raise it, or io_threads)",
                dropped,
            )

    def _save(self, job: _StorePiece) -> None:
        layout = self._layouts[job.group]
        memory = self._memories[job.group]
        started = time.perf_counter()
        stored = 0
        try:
            # A cache-sized chunk at a time: the store writes ranges the
            # checksum has just read, while they are still in the CPU cache.
            for chunk in cache_sized_chunks(len(job.hashes), layout.entry_bytes):
                chunk_hashes = job.hashes[chunk.start : chunk.stop]
                headers = self._headers.views(len(chunk))
                ranges_per_key = []
                # The gate covers the checksums: once the save is given up on
                # (its blocks may be reused), none is computed over them.
                with job.cache_access.writing():
                    for header, block_id, block_hash in zip(
                        headers, job.block_ids[chunk.start : chunk.stop], chunk_hashes, strict=True
                    ):
                        parts = memory.ranges(block_id)
                        encode_header(header, parts, layout, block_hash)
                        ranges_per_key.append([header, *parts])
                # The store commits an entry only while the gate is open once
                # all its bytes have left the cache: a save given up on (its
                # blocks may be given out and overwritten) commits nothing more.
                call = f"{type(self._store).__name__}.write_ranges"
                keys = [self._keys.key(job.group, h) for h in chunk_hashes]
                reply = self._store_call(
                    call,
                    functools.partial(
                        self._store.write_ranges,
                        keys,
                        ranges_per_key,
                        commit_gate=job.cache_access,
                    ),
                )
                results = self._store_call(
                    call, functools.partial(checked_write_results, reply, len(keys), call)
                )
                written = [h for h, ok in zip(chunk_hashes, results, strict=True) if ok]
                stored += len(written)
                # Reported even when late: the events say what the store holds.
                self._record_events(written, job.group)
        except JobAbandoned:
            pass  # given up on: counted below, or at its deadline
        except _StoreCallFailed as error:
            self._warn.warn(
                "save-raised",
                "%s store: %s; %d blocks of the save are not stored",
                self._medium,
                error,
                len(job.hashes) - stored,
            )
        except Exception:
            logger.exception("save of %d blocks failed", len(job.hashes))
        if job.end():
            self._jobs.count_save(job, stored, layout.payload_bytes, started)
        elif job.released:
            # What it committed before its gate closed is stored (and reported).
            self._counters.add_many(
                {
                    "blocks_saved": stored,
                    "bytes_saved": stored * layout.payload_bytes,
                    "saves_released": len(job.hashes) - stored,
                }
            )
        # Otherwise counted failed at its deadline.

    def release_saves_reading(
        self, request_ids: Iterable[str] = (), block_ids: Iterable[int] = ()
    ) -> list[BlockTransfer]:
        """Release every save that reads blocks of `request_ids`, or any of `block_ids`.

        Before a forward pass that may write those blocks (preempted
        requests'; blocks given out again since the last step). Nothing is
        waited for but a checksum under way: a save not started yet is
        cancelled, and one under way has its gate closed, so it commits none
        of its entries not committed yet (see the module). Their blocks not
        stored count as `saves_released`; they are not saved again (a later
        lookup misses them, it never loads wrong KV).

        Returns the save jobs this call stopped (one record per job: a batch
        of at most `batch_blocks` blocks of one group), not those that had
        ended or were given up on before. Entries a job committed before its
        gate closed stay stored, and were reported in `take_events`.
        """
        stopped = self._jobs.release_saves_reading(request_ids, block_ids)
        # The others count themselves: what they committed before their gate closed is stored.
        never_ran = sum(len(piece.hashes) for piece in stopped if piece.never_ran())
        if never_ran:
            self._counters.add("saves_released", never_ran)
        return [piece.transfer for piece in stopped]

    def take_counters(self) -> Mapping[str, float]:
        """The store's counts since the last call, once overdue saves are counted failed.

        The overdue saves are counted in the worker's own counters, so the
        step that reports these also reports them.
        """
        self._jobs.give_up_overdue(kind=TransferKind.SAVE)
        return self._store_counters() if self._store_counters is not None else {}

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish the transfers in flight (up to `timeout_s`), stop the threads, run `on_close`.

        Every step runs even when one fails (logged): a stuck save or load
        must not keep the thread pools from shutting down, nor the medium
        from closing its store.
        """
        deadline = time.monotonic() + timeout_s
        steps: list[tuple[str, Callable[[], object]]] = [
            # Up to their deadlines (or this one), then given up on.
            ("ending transfers", lambda: self._end_all(deadline)),
            # Not waiting for the threads: a job still blocked in the store
            # was given up on, and writes nothing more into the cache.
            ("stopping the load threads", self._load_pool.shutdown),
            ("stopping the save threads", self._save_pool.shutdown),
        ]
        if self._on_close is not None:
            steps.append(("closing the medium", self._on_close))
        close_in_steps(logger, "", steps)

    def _end_all(self, deadline: float) -> None:
        timeout_s = max(0.0, deadline - time.monotonic())
        if not self._jobs.end_all(deadline):
            logger.warning(
                "shutdown: transfers still running after %.0f s are given up on", timeout_s
            )
