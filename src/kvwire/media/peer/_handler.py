"""The peer medium's worker half: its pool exposed to NIXL, and loads pulled from any peer.

Saves are the CPU pool's (`CPUPoolTransferHandler`
copies blocks into this worker's pool slots). The pool and a staging area
are registered with a NIXL agent named after this peer (and this rank, in
a split engine), and the agent's record is published in the directory and
refreshed every `peer_heartbeat_s` (it expires after three of them
unrefreshed). A rank reads other peers' same rank: the share it holds.

A load reads each block where the scheduler half's lookup found it (the
transfer's payload, `FoundLocations`; the directory is asked, in one round trip, only
about blocks it came without), then pulls each entry, header and payload,
into staging: with one NIXL read per peer holding some of them (blocks
adjacent in both pools as one descriptor; its record fetched at most once
a heartbeat, and afresh after a failure), or a copy from this worker's
own pool. Each staged entry is verified (layout fingerprint, block hash,
checksum) and only then scattered into the KV cache. So bytes that moved
under the read (the holder evicted the block and reused the slot, or is
writing it right now) are refused, never loaded: a block refused, missing,
or on a peer that is gone or slower than `transfer_timeout_s` is a load
error, computed again. A read that failed withdraws the entries it relied
on from the directory (only while they still name the same slot and
generation), and a peer with no live record is forgotten.

Every directory call here (a load's lookups and peer records, the
heartbeat, withdrawals) waits at most the directory's `lookup_timeout_s`,
and none is made while the directory is down: a load then finds no location
for the blocks it came without, and its reads of peers whose record it has
not fetched fail; both are load errors, computed again.

Counts reported with the stats, beside the pool's: `peer_blocks_pulled`
and `peer_bytes_pulled` (blocks loaded from another peer over NIXL),
`peer_blocks_local` (from this worker's own pool), `peer_lookup_misses`
(no entry any more at load time), `peer_read_failures` (blocks on a peer
that could not be read: no live record, NIXL error, deadline),
`peer_stale_entries` (pulled bytes that were not the block) and
`peer_entries_withdrawn`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence, Set

import attrs

from kvwire.blocks.format import BlockLayout, CorruptBlockError, verify_entry
from kvwire.blocks.paged_cache import (
    PagedKVCaches,
    cache_sized_chunks,
    copy_on_this_thread_only,
)
from kvwire.blocks.transfers import BlockTransfer, TransferPayload
from kvwire.config import ParallelConfig
from kvwire.exceptions import JobAbandoned
from kvwire.interface.counters import Counters
from kvwire.media.base import JobResult, TransferHandler, TransferJob, TransferKind
from kvwire.media.cpu_pool.handler import CPUPoolTransferHandler
from kvwire.media.cpu_pool.pool_memory import PoolSlots
from kvwire.media.io_threads import IOThreads
from kvwire.media.jobs import JobLedger, JobPiece
from kvwire.media.peer._agent import PeerAgent
from kvwire.media.peer._directory import FoundLocations, Location, PeerDirectory, PeerRecord
from kvwire.media.peer._split import agent_name
from kvwire.media.rate_limited import RateLimitedWarning
from kvwire.media.shutdown import close_in_steps

logger = logging.getLogger(__name__)


@attrs.frozen
class PeerTransferSettings:
    peer: str
    parallel: ParallelConfig
    """This rank, and how its engine is split: a rank reads the same rank of other peers."""
    staging_blocks: int
    io_threads: int
    transfer_timeout_s: float
    heartbeat_s: float


class PeerTransferHandler(TransferHandler):
    """This peer's pool (saves), its NIXL agent, and loads from whichever peer holds a block."""

    def __init__(
        self,
        *,
        layouts: Sequence[BlockLayout],
        directory_names: Sequence[str],
        caches: Sequence[PagedKVCaches],
        num_slots: int,
        counters: Counters,
        directory: PeerDirectory,
        settings: PeerTransferSettings,
    ) -> None:
        self._layouts = tuple(layouts)
        self._caches = tuple(caches)
        self._layout = self._layouts[0]
        self._fingerprints = tuple(directory_names)
        self._settings = settings
        self._counters = counters
        self._directory = directory
        self._warn = RateLimitedWarning(logger)
        self._pool = CPUPoolTransferHandler(
            layouts=layouts,
            caches=caches,
            num_slots=num_slots,
            io_threads=settings.io_threads,
            counters=counters,
            transfer_timeout_s=settings.transfer_timeout_s,
        )
        # One staging region per load thread: a thread pulls a run of at most
        # staging_blocks entries into its region, verifies, scatters, repeats.
        self._regions_free: queue.Queue[int] = queue.Queue()
        self._staging = [
            PoolSlots(self._layout, settings.staging_blocks) for _ in range(settings.io_threads)
        ]
        for region in range(settings.io_threads):
            self._regions_free.put(region)
        # This rank's agent and record: each rank exposes its own pool.
        self._agent_name = self._rank_agent(settings.peer)
        self._agent = PeerAgent(
            self._agent_name, [self._pool.pool.memory, *(s.memory for s in self._staging)]
        )
        self._record = PeerRecord(
            agent_metadata=self._agent.metadata,
            base_address=self._pool.pool.memory.data_ptr(),
            entry_bytes=self._layout.entry_bytes,
            num_slots=num_slots,
        )
        self._threads = IOThreads(settings.io_threads, "kvwire-peer-load", copy_on_this_thread_only)
        self._changed = threading.Condition()
        self._loads: JobLedger[JobPiece] = JobLedger(
            counters=counters,
            warn=self._warn,
            label="peer medium: ",
            transfer_timeout_s=settings.transfer_timeout_s,
        )
        # Peers' records, and when each was fetched: one directory round trip per
        # peer and heartbeat, not per read.
        self._records: dict[str, tuple[float, PeerRecord]] = {}
        self._stop = threading.Event()
        if not directory.publish_peer(self._agent_name, self._record):
            logger.warning(
                "peer medium: peer %r could not publish its record yet", self._agent_name
            )
        self._heartbeat = threading.Thread(
            target=self._keep_record, name="kvwire-peer-heartbeat", daemon=True
        )
        self._heartbeat.start()

    # ---------------------------------------------------------- transfer jobs

    def submit(self, job: TransferJob) -> None:
        """A save goes to the pool; a load is pulled, one request's blocks per thread."""
        if job.kind is TransferKind.SAVE:
            self._pool.submit(job)
            return
        deadline = self._loads.begin(job)
        for transfers in _by_request(job.transfers).values():
            self._loads.start(JobPiece(job.job_id, transfers, deadline), self._threads, self._run)
        self._loads.submitted(job.job_id)

    def poll(self) -> list[JobResult]:
        return self._loads.poll() + self._pool.poll()

    def wait(self, job_ids: Iterable[int], until: float | None = None) -> bool:
        wanted = set(job_ids)
        loads = [job_id for job_id in wanted if self._loads.is_running(job_id)]
        loads_ended = self._loads.wait(loads, until)
        return self._pool.wait(wanted.difference(loads), until) and loads_ended

    def release_saves_reading(
        self, request_ids: Iterable[str], block_ids: Set[int]
    ) -> list[BlockTransfer]:
        return self._pool.release_saves_reading(request_ids, block_ids)

    # -------------------------------------------------------------- loads

    def _run(self, job: JobPiece) -> None:
        """Pull one request's blocks (every KV cache group's); failed block ids to `job.failed`."""
        started = time.perf_counter()
        failed: list[int] = []
        loaded = 0
        try:
            for transfer in job.transfers:
                loaded_here, failed_here = self._load_transfer(job, transfer)
                loaded += loaded_here
                failed.extend(failed_here)
        except JobAbandoned:
            return  # every block of it was reported failed
        except Exception:
            request_id = job.transfers[0].request_id
            logger.exception("peer medium: load of request %r failed", request_id[:64])
            failed = list(job.block_ids)
            loaded = 0
        job.failed = failed
        if job.end():
            self._loads.count_load(job, loaded, self._layout.payload_bytes, started)

    def _load_transfer(self, job: JobPiece, transfer: BlockTransfer) -> tuple[int, list[int]]:
        """Pull, verify and scatter one transfer's blocks; (blocks loaded, block ids failed)."""
        fingerprint = self._fingerprints[transfer.group]
        keys = [self._directory.entry_key(fingerprint, h) for h in transfer.block_hashes]
        locations = self._locate(keys, transfer.payload)
        region = self._take_region(job.deadline)
        if region is None:
            return 0, list(transfer.block_ids)
        staging = self._staging[region]
        loaded = 0
        failed: list[int] = []
        keep_region = True
        try:
            size = staging.num_slots
            for start in range(0, len(transfer.block_ids), size):
                stop = min(start + size, len(transfer.block_ids))
                done, failed_here, keep_region = self._load_run(
                    job, transfer, keys, locations, range(start, stop), staging, region
                )
                loaded += done
                failed.extend(failed_here)
                if not keep_region:
                    # The rest has no staging to land in: computed again.
                    failed.extend(transfer.block_ids[stop:])
                    break
        finally:
            if keep_region:
                self._regions_free.put(region)
        return loaded, failed

    def _locate(
        self, keys: Sequence[str], payload: TransferPayload | None
    ) -> list[Location | None]:
        """Each block's location: the scheduler half's, else the directory's (one round trip)."""
        found = list(payload.locations) if isinstance(payload, FoundLocations) else []
        if len(found) != len(keys):
            found = [None] * len(keys)  # none given (or not one per block): all looked up
        missing = [index for index, location in enumerate(found) if location is None]
        if missing:
            looked_up = self._directory.look_up([keys[index] for index in missing])
            for index, location in zip(missing, looked_up, strict=True):
                found[index] = location
        return found

    def _take_region(self, deadline: float) -> int | None:
        self._agent.reap()
        try:
            return self._regions_free.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return None

    def _load_run(
        self,
        job: JobPiece,
        transfer: BlockTransfer,
        keys: Sequence[str],
        locations: Sequence[Location | None],
        run: range,
        staging: PoolSlots,
        region: int,
    ) -> tuple[int, list[int], bool]:
        """One run of blocks through `staging`; (loaded, failed ids, staging still ours)."""
        layout = self._layouts[transfer.group]
        caches = self._caches[transfer.group]
        by_peer: dict[str, list[int]] = {}
        staged: list[int] = []  # indices into the transfer whose bytes are in staging
        failed: list[int] = []
        for index in run:
            location = locations[index]
            if location is None:
                self._counters.add("peer_lookup_misses")
                failed.append(transfer.block_ids[index])
            else:
                by_peer.setdefault(location.peer, []).append(index)
        keep_region = True
        for peer, indices in by_peer.items():
            # Staging slot of the transfer's index-th block: its place in the run.
            if peer == self._settings.peer:
                for index in indices:
                    slot = locations[index].slot  # type: ignore[union-attr]
                    if 0 <= slot < self._pool.pool.num_slots:
                        staging.memory[index - run.start].copy_(self._pool.pool.memory[slot])
                        staged.append(index)
                    else:
                        failed.append(transfer.block_ids[index])
                continue
            ok, keep_region = self._pull(peer, indices, locations, staging, region, run.start, job)
            if ok:
                staged += indices
            else:
                self._counters.add("peer_read_failures", len(indices))
                failed += [transfer.block_ids[index] for index in indices]
                self._withdraw([(keys[i], locations[i]) for i in indices])
            if not keep_region:
                failed += [
                    transfer.block_ids[i]
                    for other, rest in by_peer.items()
                    if other != peer
                    for i in rest
                    if i not in staged
                ]
                break
        if not keep_region:
            # A read into this staging may still land: nothing of it is used.
            return 0, sorted(set(failed) | {transfer.block_ids[i] for i in staged}), False
        stale: list[tuple[str, Location | None]] = []
        loaded = pulled = local = 0
        order = sorted(staged)
        try:
            # A cache-sized chunk at a time: the scatter copies what the check
            # has just read while it is still in the CPU's cache.
            for chunk in cache_sized_chunks(len(order), layout.entry_bytes):
                verified_ids: list[int] = []
                verified_slots: list[int] = []
                for index in order[chunk.start : chunk.stop]:
                    block_id = transfer.block_ids[index]
                    try:
                        verify_entry(
                            staging.entry(index - run.start), layout, transfer.block_hashes[index]
                        )
                        caches.check_block_id(block_id)
                    except (CorruptBlockError, IndexError) as error:
                        self._warn.warn(
                            "stale", "peer medium: not loading a pulled block: %s", error
                        )
                        self._counters.add("peer_stale_entries")
                        stale.append((keys[index], locations[index]))
                        failed.append(block_id)
                        continue
                    verified_ids.append(block_id)
                    verified_slots.append(index - run.start)
                    if locations[index].peer == self._settings.peer:  # type: ignore[union-attr]
                        local += 1
                    else:
                        pulled += 1
                with job.lock:
                    job.check()
                    caches.scatter_many(staging.payloads, verified_slots, verified_ids)
                loaded += len(verified_ids)
        finally:
            self._withdraw(stale)
            self._counters.add_many(
                {
                    "peer_blocks_pulled": pulled,
                    "peer_bytes_pulled": pulled * layout.entry_bytes,
                    "peer_blocks_local": local,
                }
            )
        return loaded, failed, True

    def _pull(
        self,
        peer: str,
        indices: Sequence[int],
        locations: Sequence[Location | None],
        staging: PoolSlots,
        region: int,
        run_start: int,
        job: JobPiece,
    ) -> tuple[bool, bool]:
        """Read these blocks from `peer`'s rank into staging; (all arrived, staging ours)."""
        peer = self._rank_agent(peer)
        record = self._peer_record(peer)
        if record is None or record.entry_bytes != self._layout.entry_bytes:
            # Gone (its record expired or never was), or of another layout.
            self._forget(peer)
            return False, True
        if not self._agent.knows(peer, record.agent_metadata):
            self._forget(peer)
            return False, True
        base = staging.memory.data_ptr()
        entry_bytes = self._layout.entry_bytes
        pieces = []
        for index in indices:
            remote = record.slot_address(locations[index].slot)  # type: ignore[union-attr]
            if remote is None:
                return False, True
            pieces.append((base + (index - run_start) * entry_bytes, remote))
        status = self._agent.read(
            peer,
            pieces,
            entry_bytes,
            min(job.deadline, time.monotonic() + self._settings.transfer_timeout_s),
            on_late_end=lambda: self._regions_free.put(region),
        )
        if status == "done":
            return True, True
        self._forget(peer)
        return False, status != "late"

    def _peer_record(self, peer: str) -> PeerRecord | None:
        """`peer`'s record: the one fetched within a heartbeat, else the directory's now."""
        now = time.monotonic()
        with self._changed:
            cached = self._records.get(peer)
        if cached is not None and now - cached[0] < self._settings.heartbeat_s:
            return cached[1]
        record = self._directory.fetch_peer(peer)
        with self._changed:
            if record is None:
                self._records.pop(peer, None)
            else:
                self._records[peer] = (now, record)
        return record

    def _forget(self, peer: str) -> None:
        """After a failure with `peer`: its agent and record are fetched afresh next time."""
        with self._changed:
            self._records.pop(peer, None)
        self._agent.forget(peer)

    def _withdraw(self, entries: Sequence[tuple[str, Location | None]]) -> None:
        present = [(key, location) for key, location in entries if location is not None]
        withdrawn = self._directory.withdraw(present)
        if withdrawn:
            self._counters.add("peer_entries_withdrawn", withdrawn)

    # -------------------------------------------------------------- upkeep

    def _rank_agent(self, peer: str) -> str:
        """The agent (and record) of `peer`'s rank holding this rank's share."""
        parallel = self._settings.parallel
        return agent_name(peer, parallel, parallel.rank)

    def _keep_record(self) -> None:
        while not self._stop.wait(self._settings.heartbeat_s):
            self._directory.publish_peer(self._agent_name, self._record)

    def take_counters(self) -> dict[str, float]:
        failures = self._directory.take_failures()
        return {"peer_directory_failures": failures} if failures else {}

    def close(self) -> None:
        """Stop announcing this peer, let the transfers end, then release NIXL and the pool.

        Every step runs even when one fails (logged).
        """
        self._stop.set()
        steps: list[tuple[str, Callable[[], object]]] = [
            ("withdrawing this peer", lambda: self._directory.withdraw_peer(self._agent_name)),
            ("ending loads", self._loads.end_all),
            ("stopping the load threads", self._threads.shutdown),
            ("closing the pool", self._pool.close),
            (
                "stopping the heartbeat",
                lambda: self._heartbeat.join(timeout=self._settings.heartbeat_s + 1),
            ),
            ("closing the NIXL agent", self._agent.close),
            ("closing the directory", self._directory.close),
        ]
        close_in_steps(logger, "peer medium: ", steps)


def _by_request(transfers: Sequence[BlockTransfer]) -> dict[str, list[BlockTransfer]]:
    grouped: dict[str, list[BlockTransfer]] = {}
    for transfer in transfers:
        grouped.setdefault(transfer.request_id, []).append(transfer)
    return grouped
