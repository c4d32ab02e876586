"""The worker side of a store-backed connector: it moves bytes, nothing else.

:class:`StoreWorker` copies blocks between the paged caches and preallocated
staging slots on the forward pass's thread (plain memory copies), and hands
the slots to background threads that talk to the :class:`BlockStore`. Loads
and saves have separate thread pools, so a backlog of saves never delays a
load the forward pass is waiting for. Every loaded entry is checked with
:func:`verify_entry` before one byte of it is copied into the cache; a block
that fails is reported by id, never raised.

Where the time goes, and what keeps it down: each block is copied out of the
cache once (into staging) on a save, and once into the cache on a load; the
checksum reads each entry while it is still in the CPU cache (on saves, a
chunk of a few MiB at a time; on loads, each entry as soon as the store has
read it, see :meth:`BlockStore.read_each`, which also lets a server send the
next entries meanwhile); a load is split between the I/O threads in long
runs, one ``read_each`` each, so that a server is asked for the next entries
across the whole run, and each staging slot goes back as soon as its entry
is in the cache; large entries of a store that can map them are
verified in place and copied straight into the cache, skipping staging
(smaller ones are cheaper to read into staging than to map); background
threads copy single-threaded, so that they do not wait on each other's
OpenMP teams.

Every transfer has a deadline (``transfer_timeout_s`` from its start): a
load still running past it is abandoned and its blocks are reported as load
errors, so the engine computes them again; a save still running past it is
abandoned and counted failed. An abandoned job may still be blocked in the
store, but it writes nothing more into the cache: it scatters only under its
run's lock, after checking it was not abandoned, so a late result never lands
in blocks the engine has taken back.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Protocol, runtime_checkable

import attrs
import torch

from kvwire.connector.types import BlockHash, BlockRemoved, BlockStored, KVCacheEvent
from kvwire.connectors.block_format import (
    HEADER_SIZE,
    BlockLayout,
    CorruptBlockError,
    verify_entry,
    write_header,
)
from kvwire.connectors.counters import Counters
from kvwire.connectors.job_threads import JobThreads
from kvwire.connectors.paged_cache import (
    CACHE_CHUNK_BYTES,
    PagedKVCaches,
    cache_sized_chunks,
    copy_on_this_thread_only,
)
from kvwire.connectors.rate_limited import RateLimitedWarning
from kvwire.connectors.staging import StagingBuffers
from kvwire.connectors.store import BlockStore
from kvwire.connectors.transfer_jobs import JobAbandoned, TransferJob
from kvwire.dtypes import DTYPES

logger = logging.getLogger(__name__)

# Mapping an entry costs a mapping, a page fault per few pages and an unmapping
# (which interrupts every other thread of the process to flush its TLB); only
# from a few MiB on does skipping the copy into staging outweigh that. Measured
# (benchmarks/connectors.py on 2 cores, loads against a plain read of the same files):
# mapped 0.2 of the bound at 1 MiB and 0.37 at 2 MiB, read into staging 0.4 and
# 0.42; at 4 MiB mapped 0.55, staged 0.42.
MIN_MAPPED_ENTRY_BYTES = 3 * 1024 * 1024


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@runtime_checkable
class MappingBlockStore(Protocol):
    """A store that can also hand out an entry mapped in memory (a file, say)."""

    def map_entry(self, key: str) -> mmap.mmap | None:
        """The entry mapped (the caller closes it), or None to read it with ``get_into``."""


@attrs.frozen
class BlockTransfer:
    """Blocks of one request in one KV cache group to move: cache block ids and their hashes."""

    request_id: str
    block_ids: tuple[int, ...]
    block_hashes: tuple[BlockHash, ...]
    # A save's context: see BlockRange.context_block_ids.
    context_block_ids: tuple[int, ...] = ()
    # The KV cache group whose layers the blocks are read from or written to.
    group: int = 0


class _LoadRun(TransferJob):
    """A load job: consecutive blocks read with one ``read_each``, into ``slots``."""

    def __init__(
        self,
        group: int,
        block_ids: tuple[int, ...],
        hashes: tuple[BlockHash, ...],
        slots: list[int],
        deadline: float,
    ) -> None:
        super().__init__(deadline)
        self.group = group
        self.block_ids = block_ids
        self.hashes = hashes
        self.slots = slots
        self.failed: list[int] = []


class _SaveJob(TransferJob):
    """A save job: entries of ``hashes`` of ``group``, in staging ``slots``, for the store."""

    def __init__(
        self, group: int, hashes: tuple[BlockHash, ...], slots: list[int], deadline: float
    ) -> None:
        super().__init__(deadline)
        self.group = group
        self.hashes = hashes
        self.slots = slots


@attrs.define(eq=False)
class _AsyncLoad:
    """A request's asynchronous load: its runs, how many have not ended, what failed so far."""

    request_id: str
    deadline: float
    remaining_jobs: int = 1
    runs: list[_LoadRun] = attrs.field(factory=list)
    failed_block_ids: set[int] = attrs.field(factory=set)


class _HeldSlots:
    """A load job's staging slots: given back as it is done with each, the rest at its end."""

    def __init__(self, staging: StagingBuffers, slots: Sequence[int]) -> None:
        self._staging = staging
        self._held = set(slots)

    def give_back(self, slots: Sequence[int]) -> None:
        if slots:
            self._held.difference_update(slots)
            self._staging.release(slots)

    def give_back_rest(self) -> None:
        rest, self._held = sorted(self._held), set()
        self._staging.release(rest)


class StoreWorker:
    """Saves and loads blocks of the registered caches through a store, off the forward pass.

    It serves every KV cache group of the engine: ``layouts`` and ``caches``
    hold one layout and one set of paged caches per group, in group order (a
    single-group engine passes one of each). A transfer names its group
    (:attr:`BlockTransfer.group`); its blocks are read from or written to
    that group's layers only, and its entries are headed, checked and keyed
    with that group's layout, so an entry of one group never loads into
    another. Entries of every group have the same size (the groups have the
    same number of layers), so one set of staging slots serves them all.

    ``key_of(group, block_hash)`` names a block's entry in the store (the
    connector's choice; by default the group layout's key), ``hash_of`` turns
    a key back into its block hash (None for another layout's; by default,
    the hash any group's layout made the key from), and ``medium`` names the
    store in the KV cache events (:meth:`take_events`).
    Slots are taken only on the caller's thread; background jobs only give
    them back, so jobs never wait on each other. A transfer still running
    ``transfer_timeout_s`` after it started is given up on (see the module).
    """

    def __init__(
        self,
        *,
        store: BlockStore,
        layouts: Sequence[BlockLayout],
        caches: Sequence[PagedKVCaches],
        staging: StagingBuffers,
        io_threads: int,
        batch_blocks: int,
        counters: Counters,
        medium: str,
        key_of: Callable[[int, BlockHash], str] | None = None,
        hash_of: Callable[[str], BlockHash | None] | None = None,
        transfer_timeout_s: float = 30.0,
    ) -> None:
        if not layouts or len(layouts) != len(caches):
            raise ValueError(
                f"StoreWorker: got {len(layouts)} layouts and {len(caches)} caches; "
                "expected one of each per KV cache group (at least one)"
            )
        if any(layout.shape != layouts[0].shape for layout in layouts):
            raise ValueError(
                "StoreWorker: layouts have shapes "
                f"{sorted({layout.shape for layout in layouts})}; every KV cache group's "
                "entries must have the same shape (one staging slot size serves them all)"
            )
        self._store = store
        self._transfer_timeout_s = transfer_timeout_s
        # Per group, built once: the hot path only indexes them.
        self._layouts = tuple(layouts)
        self._caches = tuple(caches)
        # What all groups' entries share: shape, sizes, dtype.
        self._layout = self._layouts[0]
        self._staging = staging
        self._batch_blocks = batch_blocks
        # More runs of one transfer than cores only contend for the GIL
        # between their per-entry steps (measured on 2 cores, 256 KiB Redis
        # loads on 4 I/O threads: 1.14-1.80 GB/s in 4 runs, 1.83 in one). The
        # other threads still serve other transfers.
        self._runs_per_transfer = max(1, min(io_threads, usable_cores()))
        self._counters = counters
        self._key_of = key_of if key_of is not None else self._layout_key
        self._hash_of = hash_of if hash_of is not None else self._layout_hash
        self._medium = medium
        # Large entries of a store that maps them are verified where they lie
        # and copied once, straight into the cache, instead of through staging.
        self._mapping_store = (
            store
            if isinstance(store, MappingBlockStore)
            and self._layout.entry_bytes >= MIN_MAPPED_ENTRY_BYTES
            else None
        )
        self._load_pool = JobThreads(io_threads, "kvwire-load", copy_on_this_thread_only)
        self._save_pool = JobThreads(io_threads, "kvwire-save")
        self._warn = RateLimitedWarning(logger)
        self._lock = threading.Lock()
        self._sync_loads: list[_LoadRun] = []
        self._async_loads: dict[str, _AsyncLoad] = {}
        self._finished_async: dict[str, set[int]] = {}
        self._load_errors: set[int] = set()
        self._saves_in_flight: set[_SaveJob] = set()
        self._events: list[KVCacheEvent] = []

    def _layout_key(self, group: int, block_hash: BlockHash) -> str:
        return self._layouts[group].key(block_hash)

    def _layout_hash(self, key: str) -> BlockHash | None:
        for layout in self._layouts:
            block_hash = layout.block_hash_of(key)
            if block_hash is not None:
                return block_hash
        return None

    # ----------------------------------------------------------------- loads

    def start_loads(
        self, sync_loads: Sequence[BlockTransfer], async_loads: Sequence[BlockTransfer]
    ) -> None:
        """Submit this step's loads; synchronous ones are awaited by :meth:`wait_for_loads`.

        A request's asynchronous transfers (one per KV cache group it loads)
        are one load: the request is finished once all of them are.
        """
        deadline = time.monotonic() + self._transfer_timeout_s
        for transfer in sync_loads:
            self._load_errors.update(self._submit_runs(transfer, deadline, None))
        states: dict[str, tuple[_AsyncLoad, list[int]]] = {}
        for transfer in async_loads:
            # The state's one initial "job" stands for the submission itself,
            # so the request cannot be reported finished before its last run
            # is submitted.
            if transfer.request_id not in states:
                state = _AsyncLoad(transfer.request_id, deadline)
                with self._lock:
                    self._async_loads[transfer.request_id] = state
                states[transfer.request_id] = (state, [])
            state, starved = states[transfer.request_id]
            starved.extend(self._submit_runs(transfer, deadline, state))
        for state, starved in states.values():
            self._complete_async(state, starved)

    def _submit_runs(
        self, transfer: BlockTransfer, deadline: float, state: _AsyncLoad | None
    ) -> tuple[int, ...]:
        """Submit the transfer's runs; the blocks that found no staging slot by ``deadline``.

        A run is one job: one ``read_each`` over all of its blocks, so a store
        that reads ahead (a server sending the next entries while this thread
        verifies and scatters) does so across the whole run. A transfer is
        split between the I/O threads (no more ways than there are cores), in
        runs of at least ``batch_blocks``. Slots are taken here, on the
        caller's thread, one run at a time and only after the previous run
        was submitted; a job gives its slots back as it scatters them. A
        transfer larger than the staging buffers therefore waits for earlier
        runs to progress, up to its deadline; the blocks left then are load
        errors (counted here).
        """
        count = len(transfer.block_ids)
        run_blocks = max(self._batch_blocks, -(-count // self._runs_per_transfer))
        start = 0
        while start < count:
            wanted = min(run_blocks, count - start)
            slots = self._staging.acquire(wanted, deadline - time.monotonic())
            if not slots:
                break
            end = start + len(slots)
            run = _LoadRun(
                transfer.group,
                transfer.block_ids[start:end],
                transfer.block_hashes[start:end],
                slots,
                deadline,
            )
            if state is None:
                self._sync_loads.append(run)
            else:
                with self._lock:
                    state.runs.append(run)
                    state.remaining_jobs += 1
            run.future = self._load_pool.submit(self._load, run, state)
            start = end
        starved = transfer.block_ids[start:]
        self._fail_overdue(starved)
        return starved

    def wait_for_loads(self) -> None:
        """Block until this step's synchronous loads are in the cache, failed, or overdue.

        A run still going at its deadline is abandoned: its blocks are load
        errors, and it writes nothing more into the cache.
        """
        pending, self._sync_loads = self._sync_loads, []
        if not pending:
            return
        deadline = max(run.deadline for run in pending)
        concurrent.futures.wait(
            [run.future for run in pending if run.future is not None],
            timeout=max(0.0, deadline - time.monotonic()),
        )
        for run in pending:
            if self._abandon_load(run):
                self._load_errors.update(run.block_ids)
            else:
                self._load_errors.update(run.failed)

    def _abandon_load(self, run: _LoadRun) -> bool:
        """Give up on ``run`` unless it has ended; whether it was given up on (and counted)."""
        if not run.abandon():
            return False
        if run.never_ran():
            self._staging.release(run.slots)  # its slots are the caller's to give back
        self._fail_overdue(run.block_ids)
        return True

    def _fail_overdue(self, block_ids: Sequence[int]) -> None:
        """Count blocks whose load was given up on at its deadline."""
        if not block_ids:
            return
        self._counters.add_many({"load_errors": len(block_ids), "load_timeouts": len(block_ids)})
        self._warn.warn(
            "load-timeout",
            "loads of %d blocks still running after %g s (transfer_timeout_s): "
            "reported as load errors, to be computed again",
            len(block_ids),
            self._transfer_timeout_s,
        )

    def take_finished_loads(self) -> set[str]:
        """Requests whose asynchronous loads completed (or ran past their deadline).

        Their failures join the load errors; every block of an overdue load is one.
        """
        now = time.monotonic()
        with self._lock:
            overdue = [state for state in self._async_loads.values() if state.deadline <= now]
        for state in overdue:
            self._give_up_async(state)
        with self._lock:
            finished, self._finished_async = self._finished_async, {}
        for failed in finished.values():
            self._load_errors.update(failed)
        return set(finished)

    def _give_up_async(self, state: _AsyncLoad) -> None:
        """Report ``state``'s request finished now, every block of an abandoned run failed."""
        abandoned = [run for run in state.runs if self._abandon_load(run)]
        with self._lock:
            if self._async_loads.get(state.request_id) is not state:
                return  # its last run ended meanwhile
            del self._async_loads[state.request_id]
            failed = state.failed_block_ids
            for run in state.runs:
                failed.update(run.block_ids if run in abandoned else run.failed)
            self._finished_async[state.request_id] = failed

    def is_loading(self, request_id: str) -> bool:
        """Whether an asynchronous load still writes into ``request_id``'s blocks."""
        with self._lock:
            return request_id in self._async_loads

    def load_errors_so_far(self) -> set[int]:
        """The block ids whose loads failed and are not yet taken (after :meth:`wait_for_loads`)."""
        return set(self._load_errors)

    def take_load_errors(self) -> set[int]:
        self.wait_for_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _complete_async(self, state: _AsyncLoad, failed: Iterable[int]) -> None:
        with self._lock:
            if self._async_loads.get(state.request_id) is not state:
                return  # given up on at its deadline, and reported then
            state.failed_block_ids.update(failed)
            state.remaining_jobs -= 1
            if state.remaining_jobs <= 0:
                del self._async_loads[state.request_id]
                self._finished_async[state.request_id] = state.failed_block_ids

    def _load(self, run: _LoadRun, state: _AsyncLoad | None) -> None:
        """Read, verify and scatter one run; its failed block ids go to ``run.failed``.

        An asynchronous run then counts towards its request's ``state``.
        """
        started = time.perf_counter()
        block_ids, hashes, slots = run.block_ids, run.hashes, run.slots
        failed: list[int] = []
        corrupt: list[BlockHash] = []
        loaded_bytes = 0
        held = _HeldSlots(self._staging, slots)
        try:
            # Blocks to read through staging: all of them, unless the store maps them.
            staged_ids, staged_hashes = block_ids, hashes
            if self._mapping_store is not None:
                loaded_bytes, unmapped = self._load_mapped(
                    self._mapping_store, run, failed, corrupt
                )
                staged_ids = tuple(block_ids[i] for i in unmapped)
                staged_hashes = tuple(hashes[i] for i in unmapped)
                held.give_back(slots[len(staged_ids) :])
            if staged_ids:
                loaded_bytes += self._load_staged(
                    run, staged_ids, staged_hashes, slots[: len(staged_ids)], held, failed, corrupt
                )
        except JobAbandoned:
            pass  # its caller has reported every block of it failed
        except Exception:
            # A store that raises (a bug, an unforeseen error) fails the run, not the engine.
            logger.exception("load of %d blocks failed", len(block_ids))
            failed = list(block_ids)
            loaded_bytes = 0
        finally:
            held.give_back_rest()
        if corrupt:
            # A corrupt entry would be a hit (and a failed load) for every later
            # request: drop it, so the next request that computes it saves it again.
            self._discard(run.group, corrupt)
        run.failed = failed
        if not run.end():
            return  # abandoned at its deadline: counted and reported then
        self._counters.add_many(
            {
                "blocks_loaded": len(block_ids) - len(failed),
                "bytes_loaded": loaded_bytes,
                "load_errors": len(failed),
                "load_seconds": time.perf_counter() - started,
            }
        )
        if state is not None:
            self._complete_async(state, failed)

    def _scatter(
        self,
        run: _LoadRun,
        sources: torch.Tensor,
        source_indices: Sequence[int],
        block_ids: Sequence[int],
    ) -> None:
        """Copy verified entries into the cache, unless the run's caller gave up on it.

        Under the run's lock: the caller abandons a run under it too, so once
        it has, no copy is under way and none starts (it waits at most for
        one group's copy, never for I/O).
        """
        with run.lock:
            run.check()
            self._caches[run.group].scatter_many(sources, source_indices, block_ids)

    def _load_mapped(
        self,
        store: MappingBlockStore,
        run: _LoadRun,
        failed: list[int],
        corrupt: list[BlockHash],
    ) -> tuple[int, list[int]]:
        """Verify each mapped entry in place, then copy it into the cache.

        Returns the payload bytes loaded and the indices of the blocks the
        store did not map (to read through staging instead).
        """
        loaded_bytes = 0
        unmapped: list[int] = []
        dtype = DTYPES[self._layout.dtype].torch_dtype()
        payload_bytes = self._layout.payload_bytes
        for index, (block_id, block_hash) in enumerate(zip(run.block_ids, run.hashes, strict=True)):
            key = self._key_of(run.group, block_hash)
            mapping = store.map_entry(key)
            if mapping is None:
                unmapped.append(index)
                continue
            entry = memoryview(mapping)
            payload: torch.Tensor | None = None
            try:
                if not self._verified(run.group, entry, block_id, block_hash, failed, corrupt):
                    continue
                # Only now, verified, do the bytes reach the cache.
                payload = torch.frombuffer(
                    mapping, dtype=torch.uint8, offset=HEADER_SIZE, count=payload_bytes
                )
                self._scatter(
                    run, payload.view(dtype).view(1, *self._layout.shape), (0,), (block_id,)
                )
                loaded_bytes += payload_bytes
            finally:
                # The tensor holds an export of the mapping, which must go before close.
                payload = None
                entry.release()
                mapping.close()
        return loaded_bytes, unmapped

    def _load_staged(
        self,
        run: _LoadRun,
        block_ids: Sequence[int],
        hashes: Sequence[BlockHash],
        slots: Sequence[int],
        held: _HeldSlots,
        failed: list[int],
        corrupt: list[BlockHash],
    ) -> int:
        """Read into staging and verify entry by entry; the payload bytes that reached the cache.

        Each entry is verified as soon as the store has put it in its slot,
        while it is still in the CPU cache (and, with a server, while the
        server sends the next), and the verified ones are scattered into the
        cache a cache-sized group at a time, before they leave the CPU cache
        (1 MiB groups were slower: loads of 1 MiB entries from files 0.3
        against 0.42 of a plain read, same-run A/B). A slot is given back as
        soon as its entry is in the cache or has failed, so that the next run
        can start while this one goes on.
        """
        keys = [self._key_of(run.group, block_hash) for block_hash in hashes]
        entries = [self._staging.entry(slot) for slot in slots]
        group_size = max(1, CACHE_CHUNK_BYTES // self._layout.entry_bytes)
        group_ids: list[int] = []
        group_slots: list[int] = []
        loaded = 0
        with contextlib.closing(self._store.read_each(keys, entries)) as landed:
            for index, size in landed:
                block_id = block_ids[index]
                if size is None:
                    failed.append(block_id)
                    held.give_back((slots[index],))
                    continue
                entry = entries[index][:size]
                if not self._verified(run.group, entry, block_id, hashes[index], failed, corrupt):
                    held.give_back((slots[index],))
                    continue
                group_ids.append(block_id)
                group_slots.append(slots[index])
                if len(group_ids) == group_size:
                    # Only verified entries reach the cache.
                    self._scatter(run, self._staging.payloads, group_slots, group_ids)
                    held.give_back(group_slots)
                    loaded += len(group_ids)
                    group_ids, group_slots = [], []
        self._scatter(run, self._staging.payloads, group_slots, group_ids)
        held.give_back(group_slots)
        loaded += len(group_ids)
        return loaded * self._layout.payload_bytes

    def _verified(
        self,
        group: int,
        entry: memoryview,
        block_id: int,
        block_hash: BlockHash,
        failed: list[int],
        corrupt: list[BlockHash],
    ) -> bool:
        """Whether ``entry`` may go into ``block_id`` of ``group``; if not, it is counted and noted.

        Checked against the group's own layout: another group's entry for the
        same block hash has another fingerprint, and fails here.
        """
        try:
            verify_entry(entry, self._layouts[group], block_hash)
            self._caches[group].check_block_id(block_id)
        except (CorruptBlockError, IndexError) as error:
            self._warn.warn("corrupt", "not loading block %s: %s", block_hash.hex()[:16], error)
            self._counters.add("corrupt_entries")
            corrupt.append(block_hash)
            failed.append(block_id)
            return False
        return True

    def _discard(self, group: int, hashes: list[BlockHash]) -> None:
        try:
            self._store.discard([self._key_of(group, block_hash) for block_hash in hashes])
        except Exception:
            logger.exception("discarding %d corrupt entries failed", len(hashes))
        self._record_events()

    # ---------------------------------------------------------------- events

    def take_events(self) -> list[KVCacheEvent]:
        """Blocks stored and removed since the last call, in the order this worker saw them."""
        with self._lock:
            events, self._events = self._events, []
        return events

    def _record_events(self, stored: Sequence[BlockHash] = ()) -> None:
        """Events after a store call: the blocks it stored, then the entries the store removed.

        A store reports only what it really removed: one without ``discard``
        keeps a corrupt entry, and reports nothing. Keys of another layout (a
        shared medium) are no blocks of this engine. Events name blocks by
        hash, whatever their KV cache group.
        """
        with self._lock:
            if stored:
                self._events.append(BlockStored(tuple(stored), self._medium))
            # Under the same lock, after this write's blocks: an entry evicted
            # once written is reported removed after it was reported stored.
            hashes = [self._hash_of(key) for key in self._store.take_removed_keys()]
            removed = tuple(block_hash for block_hash in hashes if block_hash is not None)
            if removed:
                self._events.append(BlockRemoved(removed, self._medium))

    # ----------------------------------------------------------------- saves

    def save(self, transfers: Sequence[BlockTransfer]) -> None:
        """Copy the blocks into staging slots, then write them in the background.

        Returns once every block is copied out of the cache: from then on the
        engine may overwrite the cache blocks. It never waits for the store:
        when every staging slot is still busy with earlier writes, the blocks
        that find no slot are not saved (counted as ``saves_dropped``), because
        a slow medium must not stall the forward pass; the next request that
        computes them saves them again. A save still running
        ``transfer_timeout_s`` after it was submitted is counted failed
        (``save_timeouts``) and writes no more of its entries.
        """
        self.expire_overdue_saves()
        dropped = 0
        batches: list[tuple[int, tuple[BlockHash, ...], list[int]]] = []
        for transfer in transfers:
            # All of a transfer's slots at once (lowest first, so mostly
            # consecutive) and one copy per layer per run of them: 128 MiB of
            # 256 KiB blocks gathered at 14.6 GB/s, against 10.5 in batches of 8.
            count = len(transfer.block_ids)
            slots = self._staging.try_acquire(count)
            dropped += count - len(slots)
            if not slots:
                continue
            self._caches[transfer.group].gather_many(
                transfer.block_ids[: len(slots)], slots, self._staging.payloads
            )
            for start in range(0, len(slots), self._batch_blocks):
                end = start + self._batch_blocks
                batches.append((transfer.group, transfer.block_hashes[start:end], slots[start:end]))
        # Submitted only once every copy is done: writers running meanwhile
        # would take the cores that torch's parallel copies wait on, and the
        # forward pass would wait several times longer for its copies (128 MiB
        # of 256 KiB blocks to Redis, 2 cores: a median 10-19 ms, against
        # 27-101 ms when each 2 or 8 MiB was submitted as soon as copied, for
        # no more throughput).
        deadline = time.monotonic() + self._transfer_timeout_s
        for group, hashes, slots in batches:
            job = _SaveJob(group, hashes, slots, deadline)
            with self._lock:
                self._saves_in_flight.add(job)
            job.future = self._save_pool.submit(self._save, job)
            job.future.add_done_callback(functools.partial(self._save_ended, job))
        if dropped:
            self._counters.add("saves_dropped", dropped)
            self._warn.warn(
                "staging-full",
                "staging buffers full: %d block saves dropped (raise "
                "kv_connector_extra_config.staging_buffer_bytes or io_threads)",
                dropped,
            )

    def _save_ended(self, job: _SaveJob, future: Future[None]) -> None:
        self._forget_save(job)

    def _forget_save(self, job: _SaveJob) -> None:
        with self._lock:
            self._saves_in_flight.discard(job)

    def _save(self, job: _SaveJob) -> None:
        hashes, slots = job.hashes, job.slots
        layout = self._layouts[job.group]
        started = time.perf_counter()
        stored = 0
        try:
            # A cache-sized chunk at a time: the store sends or writes entries
            # the checksum has just read, while they are still in the CPU cache.
            for chunk in cache_sized_chunks(len(slots), self._layout.entry_bytes):
                if job.abandoned:
                    break  # past its deadline: the rest is counted failed already
                chunk_hashes = hashes[chunk.start : chunk.stop]
                entries = [self._staging.entry(slot) for slot in slots[chunk.start : chunk.stop]]
                for block_hash, entry in zip(chunk_hashes, entries, strict=True):
                    write_header(entry, layout, block_hash)
                results = self._store.put(
                    [self._key_of(job.group, h) for h in chunk_hashes], entries
                )
                written = [h for h, ok in zip(chunk_hashes, results, strict=True) if ok]
                stored += len(written)
                # Reported even when late: the events say what the store holds.
                self._record_events(written)
        except Exception:
            logger.exception("save of %d blocks failed", len(hashes))
        finally:
            self._staging.release(slots)
        if not job.end():
            return  # counted failed at its deadline
        self._counters.add_many(
            {
                "blocks_saved": stored,
                "bytes_saved": stored * self._layout.payload_bytes,
                "save_errors": len(hashes) - stored,
                "save_seconds": time.perf_counter() - started,
            }
        )

    def expire_overdue_saves(self) -> None:
        """Count the saves still running past their deadline as failed, and stop waiting for them.

        Each such save writes none of its entries it has not started yet; a
        write already in the store's hands may still land (and is then
        reported in the KV cache events), but the save counts failed.
        """
        now = time.monotonic()
        with self._lock:
            overdue = [job for job in self._saves_in_flight if job.deadline <= now]
        for job in overdue:
            if job.abandon():
                if job.never_ran():
                    self._staging.release(job.slots)
                self._counters.add_many(
                    {"save_errors": len(job.hashes), "save_timeouts": len(job.hashes)}
                )
                self._warn.warn(
                    "save-timeout",
                    "a save of %d blocks still running after %g s (transfer_timeout_s) "
                    "is counted failed",
                    len(job.hashes),
                    self._transfer_timeout_s,
                )
            self._forget_save(job)

    def wait_for_saves(self, timeout_s: float | None = None) -> bool:
        """Block until every submitted save is written or overdue; False if ``timeout_s`` ran out.

        Without ``timeout_s`` it still ends: at the latest when the last
        save's own deadline passes.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self.expire_overdue_saves()
            with self._lock:
                pending = list(self._saves_in_flight)
            if not pending:
                return True
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return False
            wake = min(job.deadline for job in pending)
            if deadline is not None:
                wake = min(wake, deadline)
            # No exception to catch: wait() reports what ended, timed out or not.
            concurrent.futures.wait(
                [job.future for job in pending if job.future is not None],
                timeout=max(0.0, wake - now),
            )

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish the transfers in flight (up to ``timeout_s``), then stop the threads.

        Every step runs even when one fails (logged): a stuck save or load
        must not keep the thread pools from shutting down.
        """
        deadline = time.monotonic() + timeout_s
        steps: list[tuple[str, Callable[[], object]]] = [
            ("waiting for loads", self.wait_for_loads),
            ("waiting for saves", lambda: self._wait_for_saves_at_close(deadline)),
            ("ending loads", lambda: self._end_loads(deadline)),
            # Not waiting for the threads: a job still blocked in the store
            # was given up on, and writes nothing more into the cache.
            ("stopping the load threads", self._load_pool.shutdown),
            ("stopping the save threads", self._save_pool.shutdown),
        ]
        for what, step in steps:
            try:
                step()
            except Exception:
                logger.exception("shutdown: %s failed", what)

    def _wait_for_saves_at_close(self, deadline: float) -> None:
        timeout_s = max(0.0, deadline - time.monotonic())
        if not self.wait_for_saves(timeout_s):
            logger.warning("shutdown: saves still in flight after %.0f s are dropped", timeout_s)

    def _end_loads(self, deadline: float) -> None:
        """Wait for the asynchronous loads up to their deadlines (or ``deadline``), then give up.

        The synchronous ones ended or were given up on in :meth:`wait_for_loads`.
        """
        with self._lock:
            states = list(self._async_loads.values())
        if not states:
            return
        until = min(deadline, max(state.deadline for state in states))
        concurrent.futures.wait(
            [run.future for state in states for run in state.runs if run.future is not None],
            timeout=max(0.0, until - time.monotonic()),
        )
        for state in states:
            self._give_up_async(state)
