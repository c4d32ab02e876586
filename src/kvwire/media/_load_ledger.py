"""The load bookkeeping every transfer handler shares: what a load is waited for, and what failed.

A handler splits each load into jobs (:class:`~kvwire.media._transfer_jobs.TransferJob`
with the block ids they write, and those that failed) and runs them on its
threads; :class:`LoadLedger` keeps the rest. A step's synchronous loads are
waited for, each at most until its deadline, before the forward pass; a
request's asynchronous load (its jobs of every KV cache group) is reported
finished once its last job ended, or once its deadline passed, when every
block of a job still running is a load error. Either way, a job given up on
writes nothing more into the cache: :meth:`TransferJob.abandon` stops its
writes under the job's lock, and a medium whose writes are system calls the
lock cannot stop closes its own gate in ``after_abandon`` (which may raise,
as :class:`~kvwire.media.store.base.LateWriteError` does, once every job
was given up on).

The block ids that failed, synchronous or asynchronous, are kept until the
connector takes them (``get_block_ids_with_load_errors``).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, TypeVar

import attrs

from kvwire.interface.counters import Counters
from kvwire.media._rate_limited import RateLimitedWarning
from kvwire.media._transfer_jobs import BlockJob

__all__ = ["AsyncLoad", "LedgerLoadCalls", "LoadLedger"]


JobT = TypeVar("JobT", bound=BlockJob)


@attrs.define(eq=False)
class AsyncLoad(Generic[JobT]):
    """A request's asynchronous load: its jobs, how many have not ended, what failed so far.

    ``remaining`` starts at one for the submission itself, so the load
    cannot finish before its last job is submitted (:meth:`LoadLedger.submitted`).
    """

    request_id: str
    deadline: float
    jobs: list[JobT] = attrs.field(factory=list)
    remaining: int = 1
    failed: set[int] = attrs.field(factory=set)


class LoadLedger(Generic[JobT]):
    """A handler's loads: this step's synchronous jobs, each request's asynchronous load, errors.

    ``counters`` gets ``load_errors`` and ``load_timeouts`` for the blocks of
    jobs given up on at their deadline, warned about (rate-limited, through
    ``warn``) with ``label`` before the message. ``after_abandon(job)`` runs
    for each job given up on (see the module). The handler calls
    :meth:`add_sync` or :meth:`begin_async`/:meth:`add_async`/:meth:`submitted`
    as it submits, and :meth:`job_ended` from a job that ended by itself.
    """

    def __init__(
        self,
        *,
        counters: Counters,
        warn: RateLimitedWarning,
        label: str,
        transfer_timeout_s: float,
        after_abandon: Callable[[JobT], None] | None = None,
    ) -> None:
        self._counters = counters
        self._warn = warn
        self._label = label
        self._transfer_timeout_s = transfer_timeout_s
        self._after_abandon = after_abandon
        self._lock = threading.Lock()
        self._sync: list[JobT] = []
        self._async: dict[str, AsyncLoad[JobT]] = {}
        self._finished: dict[str, set[int]] = {}
        self._errors: set[int] = set()

    # ------------------------------------------------------ synchronous loads

    def add_sync(self, job: JobT) -> None:
        """A job of this step's synchronous loads (waited for by :meth:`wait_for_sync`)."""
        self._sync.append(job)

    def wait_for_sync(self) -> None:
        """Block until this step's synchronous jobs ended, or their deadline passed.

        A job still running then is given up on: its blocks are load errors.
        """
        pending, self._sync = self._sync, []
        if not pending:
            return
        deadline = max(job.deadline for job in pending)
        concurrent.futures.wait(
            [job.future for job in pending if job.future is not None],
            timeout=max(0.0, deadline - time.monotonic()),
        )
        abandoned, late = self._abandon(pending)
        for job in pending:
            self._errors.update(job.block_ids if job in abandoned else job.failed)
        if late is not None:
            raise late

    # ----------------------------------------------------- asynchronous loads

    def begin_async(self, request_id: str, deadline: float) -> AsyncLoad[JobT]:
        """The asynchronous load of ``request_id`` this step, to add jobs to."""
        state: AsyncLoad[JobT] = AsyncLoad(request_id, deadline)
        with self._lock:
            self._async[request_id] = state
        return state

    def add_async(self, state: AsyncLoad[JobT], job: JobT) -> None:
        """``job`` is one of ``state``'s; add it before submitting it."""
        with self._lock:
            state.jobs.append(job)
            state.remaining += 1

    def submitted(self, state: AsyncLoad[JobT]) -> None:
        """Every job of ``state`` is submitted: it finishes once they all ended."""
        self._count_down(state, ())

    def job_ended(self, state: AsyncLoad[JobT], job: JobT) -> None:
        """``job`` of ``state`` ended by itself (its ``end()`` won): its failures count."""
        self._count_down(state, job.failed)

    def _count_down(self, state: AsyncLoad[JobT], failed: Iterable[int]) -> None:
        with self._lock:
            if self._async.get(state.request_id) is not state:
                return  # given up on at its deadline, and reported then
            state.failed.update(failed)
            state.remaining -= 1
            if state.remaining <= 0:
                del self._async[state.request_id]
                self._finished[state.request_id] = state.failed

    def is_loading(self, request_id: str) -> bool:
        """Whether an asynchronous load still writes into ``request_id``'s blocks."""
        with self._lock:
            return request_id in self._async

    def take_finished(self) -> set[str]:
        """Requests whose asynchronous loads ended (or were given up on) since the last call.

        A load past its deadline is given up on first; its failures join the
        load errors.
        """
        now = time.monotonic()
        with self._lock:
            overdue = [
                state
                for state in self._async.values()
                if state.deadline <= now or any(job.never_ran() for job in state.jobs)
            ]
        for state in overdue:
            self.give_up_async(state)
        with self._lock:
            finished, self._finished = self._finished, {}
        for failed in finished.values():
            self._errors.update(failed)
        return set(finished)

    def give_up_async(self, state: AsyncLoad[JobT]) -> None:
        """Report ``state``'s request finished now, every block of a job given up on failed.

        Should ``after_abandon`` raise, every job is still given up on, the
        request stays unfinished (its blocks kept) and the error is raised; a
        later call reports it finished.
        """
        with self._lock:
            jobs = list(state.jobs)
        abandoned, late = self._abandon(jobs)
        if late is not None:
            raise late
        with self._lock:
            if self._async.get(state.request_id) is not state:
                return  # its last job ended meanwhile
            del self._async[state.request_id]
            for job in jobs:
                state.failed.update(job.block_ids if job in abandoned else job.failed)
            self._finished[state.request_id] = state.failed

    def wait_out(self, request_ids: Iterable[str]) -> None:
        """Wait for these requests' asynchronous loads up to their deadlines, then give up.

        For requests whose blocks are about to be reused (preempted): they are
        reported finished by the next :meth:`take_finished`.
        """
        with self._lock:
            states = [self._async[rid] for rid in set(request_ids) if rid in self._async]
        self._end(states, None)

    def end_async(self, until: float | None = None) -> None:
        """At shutdown: wait for asynchronous loads to their deadlines (or ``until``); give up."""
        with self._lock:
            states = list(self._async.values())
        self._end(states, until)

    def _end(self, states: Sequence[AsyncLoad[JobT]], until: float | None) -> None:
        if not states:
            return
        deadline = max(state.deadline for state in states)
        if until is not None:
            deadline = min(deadline, until)
        concurrent.futures.wait(
            [job.future for state in states for job in state.jobs if job.future is not None],
            timeout=max(0.0, deadline - time.monotonic()),
        )
        for state in states:
            self.give_up_async(state)

    # ----------------------------------------------------------------- errors

    def errors_so_far(self) -> set[int]:
        """The block ids whose loads failed and are not taken yet (after :meth:`wait_for_sync`)."""
        return set(self._errors)

    def take_errors(self) -> set[int]:
        """The block ids whose loads failed since the last call (the step's loads waited for)."""
        self.wait_for_sync()
        errors, self._errors = self._errors, set()
        return errors

    def count_ended(self, job: JobT, loaded: int, payload_bytes: int, started: float) -> None:
        """Count a job that ended by itself: ``loaded`` blocks of ``payload_bytes`` each.

        Its blocks not loaded (:attr:`~kvwire.media._transfer_jobs.BlockJob.failed`)
        count as load errors; ``started`` is its ``time.perf_counter()`` at start.
        """
        self._counters.add_many(
            {
                "blocks_loaded": loaded,
                "bytes_loaded": loaded * payload_bytes,
                "load_errors": len(job.failed),
                "load_seconds": time.perf_counter() - started,
            }
        )

    # ------------------------------------------------------------- giving up

    def _abandon(self, jobs: Sequence[JobT]) -> tuple[set[JobT], Exception | None]:
        """Give up on each of ``jobs`` not ended; those given up on, now or before, and an error.

        Every job is given up on before any error is raised: a job after one
        whose ``after_abandon`` raised must not go on writing into the cache.
        The first error is returned, for the caller to raise once it has
        recorded the jobs.
        """
        abandoned: set[JobT] = set()
        late: Exception | None = None
        overdue = 0
        for job in jobs:
            try:
                if job.abandon():
                    overdue += len(job.block_ids)
                    abandoned.add(job)
                    if self._after_abandon is not None:
                        self._after_abandon(job)
                elif job.abandoned:
                    # Given up on before (by a call that raised): its blocks never
                    # loaded, whatever it left in its failures.
                    abandoned.add(job)
            except Exception as error:
                late = late or error
        if overdue:
            self._counters.add_many({"load_errors": overdue, "load_timeouts": overdue})
            self._warn.warn(
                "load-timeout",
                "%sloads of %d blocks still running after %g s (transfer_timeout_s): "
                "reported as load errors, to be computed again",
                self._label,
                overdue,
                self._transfer_timeout_s,
            )
        return abandoned, late


class LedgerLoadCalls:
    """The :class:`~kvwire.media.base.TransferHandler` load calls, answered by a ledger.

    For a handler that keeps its loads in ``self._loads``: it then implements
    only the transfers themselves (starting loads, saves, releasing saves,
    what is busy, closing).
    """

    _loads: LoadLedger[Any]

    def wait_for_loads(self) -> None:
        """Block until this step's synchronous loads ended, failed or ran past their deadline."""
        self._loads.wait_for_sync()

    def load_errors_so_far(self) -> set[int]:
        """The block ids whose loads failed and are not yet taken (after :meth:`wait_for_loads`)."""
        return self._loads.errors_so_far()

    def take_load_errors(self) -> set[int]:
        """The block ids whose loads failed since the last call (this step's loads waited for)."""
        return self._loads.take_errors()

    def take_finished_loads(self) -> set[str]:
        """Requests whose asynchronous loads ended (or ran past their deadline) since last asked."""
        return self._loads.take_finished()

    def is_loading(self, request_id: str) -> bool:
        """Whether an asynchronous load still writes into ``request_id``'s blocks."""
        return self._loads.is_loading(request_id)
