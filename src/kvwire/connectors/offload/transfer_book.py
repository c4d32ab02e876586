"""The offload connector's worker half's record of the jobs it gave a medium: by request and step.

A `kvwire.media.TransferHandler` only runs jobs: it is told
to start one, says which ended and which of their blocks failed, and waits
for some (its `kvwire.media.JobLedger` keeps the pieces of each
job on its I/O threads, their deadlines and giving up). `TransferBook` is the
other side of that call, kept by the connector above any medium: which
request and which engine step each job id serves, turned into what the
connector reports to the engine, the same for every medium:

- a step's synchronous loads are one job, waited for before the forward
  pass; the block ids that failed are the step's load errors, kept until
  the engine takes them (`get_block_ids_with_load_errors`);
- a request's asynchronous load is one job (every KV cache group's blocks
  of it); the request is finished receiving once the job ended, and only
  then do its failed blocks join the load errors;
- each request's saves are one job per step; a request is busy while a job
  of its saves or asynchronous load has not ended (its blocks must be kept);
- a preempted request's asynchronous load is waited for, up to its
  deadline, before its blocks are given out again;
- a load's failed blocks are zeroed (`scrub`) as soon as the handler
  reports them, before the engine hears of them or can give them out again:
  whatever the medium left there is never read (`kvwire.blocks.scrub`).

Giving up on a job at its deadline is the handler's (its ledger's): it alone
can stop a job's writes into the cache. The book never sees a piece or a
thread, and the ledger never a request's state or an engine step.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence, Set

from kvwire.blocks.transfers import BlockTransfer
from kvwire.interface.types import KVCacheEvent
from kvwire.media.base import JobResult, TransferHandler, TransferJob, TransferKind

__all__ = ["Scrub", "TransferBook"]

Scrub = Callable[[int, Sequence[int]], int]
"""Zeroes blocks of a KV cache group (`BlockScrubber.scrub`); how many it zeroed."""


class TransferBook:
    """The jobs one connector gave `handler`, by engine step and request; not thread-safe.

    Called from the thread that drives the engine's steps only, as the
    connector's calls are. `scrub` zeroes the blocks a load reports failed
    (the connector's worker half always passes one; a medium's own tests
    may not).
    """

    def __init__(self, handler: TransferHandler, scrub: Scrub | None = None) -> None:
        self.handler = handler
        self._scrub = scrub
        self._scrubbed = 0
        # Each load job's transfers until it ended: which group each failed block is of.
        self._loads: dict[int, tuple[BlockTransfer, ...]] = {}
        self._job_ids = itertools.count()
        # This step's synchronous load jobs, not waited for yet.
        self._sync: list[int] = []
        # Each job that serves one request: asynchronous loads and saves.
        self._request_of: dict[int, str] = {}
        self._async_loads: set[int] = set()
        self._async_loads_of: dict[str, set[int]] = {}
        # Jobs not ended, per request: its blocks are in use while any is.
        self._busy: Counter[str] = Counter()
        # Failed blocks of a request's asynchronous load, until it is reported finished.
        self._async_failed: dict[str, set[int]] = {}
        self._finished: set[str] = set()
        self._errors: set[int] = set()

    # --------------------------------------------------------------- loads

    def start_loads(
        self, loads: Sequence[BlockTransfer], async_loads: Sequence[BlockTransfer]
    ) -> None:
        """Submit this step's loads: `loads` before the forward pass, `async_loads` after."""
        if loads:
            self._sync.append(self._submit(TransferKind.LOAD, tuple(loads)))
        for request_id, transfers in _by_request(async_loads).items():
            job_id = self._submit(TransferKind.LOAD, transfers, request_id)
            self._async_loads.add(job_id)
            self._async_loads_of.setdefault(request_id, set()).add(job_id)
            self._async_failed.setdefault(request_id, set())

    def wait_for_loads(self) -> None:
        """Block until this step's synchronous loads ended (or their deadline passed)."""
        pending, self._sync = self._sync, []
        if pending:  # called once per layer: the later calls have nothing to do
            try:
                self.handler.wait(pending)
            finally:
                # A wait that raised (a read still writing past its grace) has
                # given the jobs up: their failed blocks are errors all the same.
                self._poll()

    def load_errors_so_far(self) -> set[int]:
        """Block ids whose loads failed and were not taken yet (after `wait_for_loads`)."""
        return set(self._errors)

    def take_load_errors(self) -> set[int]:
        """Block ids whose loads failed since the last call (this step's loads waited for)."""
        self.wait_for_loads()
        errors, self._errors = self._errors, set()
        return errors

    def wait_for_async_loads(self, timeout_s: float) -> None:
        """Block until every asynchronous load in flight ended, for at most `timeout_s`."""
        if self._async_loads:
            self.handler.wait(list(self._async_loads), time.monotonic() + timeout_s)

    def take_finished_loads(self) -> set[str]:
        """Requests whose asynchronous loads all ended (or were given up on) since the last call."""
        self._poll()
        finished, self._finished = self._finished, set()
        for request_id in finished:
            self._errors |= self._async_failed.pop(request_id, set())
        return finished

    # --------------------------------------------------------------- saves

    def save(self, saves: Sequence[BlockTransfer]) -> None:
        """Submit these saves, one job per request; returns at once."""
        for request_id, transfers in _by_request(saves).items():
            self._submit(TransferKind.SAVE, transfers, request_id)

    def release_saves_reading(
        self, request_ids: Iterable[str], block_ids: Set[int]
    ) -> list[BlockTransfer]:
        """Before a forward pass writes these blocks: wait out loads, release saves reading them.

        The asynchronous loads of `request_ids` (preempted: their blocks
        are about to be reused) are waited for up to their deadline, then
        given up on; they are reported finished by the next
        `take_finished_loads`. Returns the saves the handler stopped.
        Polls the handler last, so `is_busy` counts what ended.
        """
        request_ids = set(request_ids)
        loading = [job_id for rid in request_ids for job_id in self._async_loads_of.get(rid, ())]
        if loading:
            self.handler.wait(loading)
        released = self.handler.release_saves_reading(request_ids, block_ids)
        self._poll()  # the jobs waited out, and any stopped, have ended
        return released

    def wait_for_saves(self, timeout_s: float | None = None) -> bool:
        """Block until every save submitted so far ended; False if `timeout_s` ran out.

        Without `timeout_s` it still ends, by the last save's deadline.
        """
        until = None if timeout_s is None else time.monotonic() + timeout_s
        saves = [job_id for job_id in self._request_of if job_id not in self._async_loads]
        ended = self.handler.wait(saves, until) if saves else True
        self._poll()
        return ended

    # ------------------------------------------------------------ requests

    def is_busy(self, request_id: str) -> bool:
        """Whether a save or asynchronous load of `request_id` had not ended when last polled.

        `take_finished_loads` polls, and the connector asks right after it.
        """
        return self._busy[request_id] > 0

    # -------------------------------------------------------------- upkeep

    def take_events(self) -> list[KVCacheEvent]:
        """The handler's KV cache events since the last call."""
        return self.handler.take_events()

    def take_counters(self) -> Mapping[str, float]:
        """The handler's own counts since the last call, and the failed blocks zeroed."""
        counts = self.handler.take_counters()
        if not self._scrubbed:
            return counts
        with_scrubbed = {**counts, "load_blocks_scrubbed": float(self._scrubbed)}
        self._scrubbed = 0
        return with_scrubbed

    def close(self) -> None:
        """Close the handler: it lets its jobs end, each within its deadline."""
        self.handler.close()

    # ---------------------------------------------------------------------

    def _submit(
        self,
        kind: TransferKind,
        transfers: tuple[BlockTransfer, ...],
        request_id: str | None = None,
    ) -> int:
        job_id = next(self._job_ids)
        if request_id is not None:
            self._request_of[job_id] = request_id
            self._busy[request_id] += 1
        if kind is TransferKind.LOAD:
            self._loads[job_id] = transfers
        self.handler.submit(TransferJob(job_id, kind, transfers))
        return job_id

    def _poll(self) -> None:
        for result in self.handler.poll():
            self._record(result)

    def _record(self, result: JobResult) -> None:
        loaded = self._loads.pop(result.job_id, ())
        if result.failed and self._scrub is not None:
            # Before the failure is known to anyone: the blocks are still this load's.
            for transfer in loaded:
                failed = [block for block in transfer.block_ids if block in result.failed]
                if failed:
                    self._scrubbed += self._scrub(transfer.group, failed)
        request_id = self._request_of.pop(result.job_id, None)
        if request_id is None:  # a step's synchronous loads
            self._errors |= result.failed
            return
        self._busy[request_id] -= 1
        if self._busy[request_id] <= 0:
            del self._busy[request_id]
        if result.job_id not in self._async_loads:
            return
        self._async_loads.discard(result.job_id)
        self._async_failed.setdefault(request_id, set()).update(result.failed)
        loading = self._async_loads_of[request_id]
        loading.discard(result.job_id)
        if not loading:
            del self._async_loads_of[request_id]
            self._finished.add(request_id)


def _by_request(transfers: Sequence[BlockTransfer]) -> dict[str, tuple[BlockTransfer, ...]]:
    """The transfers of each request, in their order."""
    grouped: dict[str, list[BlockTransfer]] = {}
    for transfer in transfers:
        grouped.setdefault(transfer.request_id, []).append(transfer)
    return {request_id: tuple(group) for request_id, group in grouped.items()}
