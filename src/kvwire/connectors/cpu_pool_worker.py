"""The CPU-offload connector's worker side: the pool memory and the copies.

The pool is allocated once: ``num_slots`` entries, each a ``block_format``
header followed by one block of every layer (cross-layer layout). Which slot
holds what is decided by the scheduler side (:mod:`kvwire.connectors.cpu_pool_index`);
this side only copies. Stores run on a background thread and complete
asynchronously; loads verify each slot's header and checksum before
copying it into the cache.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import attrs

from kvwire.connector.types import BlockHash
from kvwire.connectors.block_format import (
    BlockLayout,
    CorruptBlockError,
    verify_entry,
    write_header,
)
from kvwire.connectors.counters import Counters
from kvwire.connectors.paged_cache import (
    PagedKVCaches,
    cache_sized_chunks,
    copy_on_this_thread_only,
)
from kvwire.connectors.rate_limited import RateLimitedWarning
from kvwire.connectors.staging import StagingBuffers

logger = logging.getLogger(__name__)

# Smaller pieces are not worth a thread hand-off.
_MIN_BLOCKS_PER_PIECE = 4


@attrs.frozen
class PoolTransfer:
    """Blocks of one request between cache block ids and pool slots."""

    request_id: str
    block_ids: tuple[int, ...]
    slots: tuple[int, ...]
    block_hashes: tuple[BlockHash, ...]
    # A store's context: see BlockRange.context_block_ids.
    context_block_ids: tuple[int, ...] = ()


class CPUPoolWorker:
    """Owns the pool tensor; copies blocks between it and the paged caches off the forward pass."""

    def __init__(
        self,
        *,
        layout: BlockLayout,
        caches: PagedKVCaches,
        num_slots: int,
        io_threads: int,
        counters: Counters,
    ) -> None:
        self._layout = layout
        self._caches = caches
        self.pool = StagingBuffers(layout, num_slots)
        self._counters = counters
        self._io_threads = io_threads
        self._warn = RateLimitedWarning(logger)
        self._store_pool = ThreadPoolExecutor(
            io_threads, thread_name_prefix="kvwire-cpu-store", initializer=copy_on_this_thread_only
        )
        self._load_pool = ThreadPoolExecutor(
            io_threads, thread_name_prefix="kvwire-cpu-load", initializer=copy_on_this_thread_only
        )
        self._changed = threading.Condition()
        self._jobs_per_request: dict[str, int] = {}
        self._sync_loads: list[Future[list[int]]] = []
        self._finished_async: dict[str, list[int]] = {}
        self._async_failed: dict[str, list[int]] = {}
        self._async_pieces_left: dict[str, int] = {}
        self._load_errors: set[int] = set()

    # --------------------------------------------------- per-request jobs

    def _job_started(self, request_id: str) -> None:
        with self._changed:
            self._jobs_per_request[request_id] = self._jobs_per_request.get(request_id, 0) + 1

    def _job_done(self, request_id: str) -> None:
        with self._changed:
            left = self._jobs_per_request[request_id] - 1
            if left:
                self._jobs_per_request[request_id] = left
            else:
                del self._jobs_per_request[request_id]
            self._changed.notify_all()

    def is_busy(self, request_id: str) -> bool:
        """Whether a store or asynchronous load of ``request_id`` is still running."""
        with self._changed:
            return request_id in self._jobs_per_request

    def wait_for_requests(self, request_ids: Iterable[str]) -> None:
        """Block until no transfer of these requests runs (their blocks are about to be reused)."""
        wanted = set(request_ids)
        with self._changed:
            self._changed.wait_for(lambda: not wanted & self._jobs_per_request.keys())

    def wait_for_all(self, timeout_s: float | None = None) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: not self._jobs_per_request, timeout_s)

    # -------------------------------------------------------------- stores

    def store(self, transfers: Sequence[PoolTransfer]) -> None:
        """Start copying blocks into their pool slots; completion shows in :meth:`is_busy`."""
        for transfer in transfers:
            for piece in self._split(transfer):
                self._job_started(piece.request_id)
                self._store_pool.submit(self._store, piece)

    def _split(self, transfer: PoolTransfer) -> list[PoolTransfer]:
        """Up to one piece per thread, so a large transfer uses every copy thread."""
        count = len(transfer.block_ids)
        pieces = max(1, min(self._io_threads, count // _MIN_BLOCKS_PER_PIECE))
        bounds = [count * i // pieces for i in range(pieces + 1)]
        return [
            PoolTransfer(
                transfer.request_id,
                transfer.block_ids[start:end],
                transfer.slots[start:end],
                transfer.block_hashes[start:end],
                transfer.context_block_ids,
            )
            for start, end in itertools.pairwise(bounds)
        ]

    def _store(self, transfer: PoolTransfer) -> None:
        started = time.perf_counter()
        stored = 0
        try:
            # Chunk by chunk, so each checksum reads entries the copy has just
            # written while they are still in the CPU cache.
            for chunk in cache_sized_chunks(len(transfer.slots), self._layout.entry_bytes):
                slots = transfer.slots[chunk.start : chunk.stop]
                self._caches.gather_many(
                    transfer.block_ids[chunk.start : chunk.stop], slots, self.pool.payloads
                )
                for slot, block_hash in zip(
                    slots, transfer.block_hashes[chunk.start : chunk.stop], strict=True
                ):
                    write_header(self.pool.entry(slot), self._layout, block_hash)
                    stored += 1
        except Exception:
            # The slots keep whatever they had; their headers no longer match,
            # so a later load reports them instead of copying them.
            logger.exception("CPU offload: store of request %r failed", transfer.request_id)
        finally:
            # Counted before the job is marked done, so whoever waits for it sees them.
            self._counters.add_many(
                {
                    "blocks_saved": stored,
                    "bytes_saved": stored * self._layout.payload_bytes,
                    "save_errors": len(transfer.block_ids) - stored,
                    "save_seconds": time.perf_counter() - started,
                }
            )
            self._job_done(transfer.request_id)

    # --------------------------------------------------------------- loads

    def start_loads(
        self, sync_loads: Sequence[PoolTransfer], async_loads: Sequence[PoolTransfer]
    ) -> None:
        for transfer in sync_loads:
            for piece in self._split(transfer):
                self._sync_loads.append(self._load_pool.submit(self._load, piece))
        for transfer in async_loads:
            pieces = self._split(transfer)
            with self._changed:
                self._async_failed[transfer.request_id] = []
                self._async_pieces_left[transfer.request_id] = len(pieces)
            for piece in pieces:
                self._job_started(piece.request_id)
            for piece in pieces:
                self._load_pool.submit(self._load_async, piece)

    def wait_for_loads(self) -> None:
        pending, self._sync_loads = self._sync_loads, []
        for future in pending:
            self._load_errors.update(future.result())

    def take_finished_loads(self) -> set[str]:
        with self._changed:
            finished, self._finished_async = self._finished_async, {}
        for failed in finished.values():
            self._load_errors.update(failed)
        return set(finished)

    def load_errors_so_far(self) -> set[int]:
        """The block ids whose loads failed and are not yet taken (after :meth:`wait_for_loads`)."""
        return set(self._load_errors)

    def take_load_errors(self) -> set[int]:
        self.wait_for_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _load_async(self, piece: PoolTransfer) -> None:
        failed = self._load(piece)
        request_id = piece.request_id
        with self._changed:
            self._async_failed[request_id].extend(failed)
            self._async_pieces_left[request_id] -= 1
            if not self._async_pieces_left[request_id]:  # the request's last piece
                del self._async_pieces_left[request_id]
                self._finished_async[request_id] = self._async_failed.pop(request_id)
        self._job_done(request_id)

    def _load(self, transfer: PoolTransfer) -> list[int]:
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
                        verify_entry(self.pool.entry(slot), self._layout, block_hash)
                        self._caches.check_block_id(block_id)
                    except (CorruptBlockError, IndexError) as error:
                        self._warn.warn(
                            "corrupt", "CPU offload: not loading slot %d: %s", slot, error
                        )
                        self._counters.add("corrupt_entries")
                        failed.append(block_id)
                        continue
                    verified_ids.append(block_id)
                    verified_slots.append(slot)
                # Only verified entries reach the cache.
                self._caches.scatter_many(self.pool.payloads, verified_slots, verified_ids)
        except Exception:
            # Never an exception into the engine: the whole transfer is reported failed.
            logger.exception("CPU offload: load of request %r failed", transfer.request_id)
            failed = list(transfer.block_ids)
        loaded = len(transfer.block_ids) - len(failed)
        self._counters.add_many(
            {
                "blocks_loaded": loaded,
                "bytes_loaded": loaded * self._layout.payload_bytes,
                "load_errors": len(failed),
                "load_seconds": time.perf_counter() - started,
            }
        )
        return failed

    def close(self, timeout_s: float = 30.0) -> None:
        self.wait_for_loads()
        if not self.wait_for_all(timeout_s):
            logger.warning(
                "CPU offload: transfers still running after %.0f s at shutdown", timeout_s
            )
        self._store_pool.shutdown(wait=False, cancel_futures=True)
        self._load_pool.shutdown(wait=False, cancel_futures=True)
