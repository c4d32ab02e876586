"""The load jobs of a transfer handler: their pieces, their outcomes, giving up at a deadline.

A handler runs each load [`TransferJob`][kvwire.media.TransferJob] as pieces
(`BlockJob`, with the block ids they write, and those that failed) on its
threads; `LoadLedger` keeps the rest. A job ends once its last piece ended, or
once its deadline passed, when every block of a piece still running is failed.
Either way, a piece given up on writes nothing more into the cache:
`BlockJob.abandon` stops its writes under the piece's lock, and a medium whose
writes are system calls the lock cannot stop closes its own gate in
`after_abandon` (which may raise, as
[`LateWriteError`][kvwire.media.LateWriteError] does, once every piece was
given up on).

Which request a job serves and which step waits for it is the connector's
bookkeeping (`TransferBook`).
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
from kvwire.media.base import JobResult

__all__ = ["LoadJob", "LoadLedger"]


PieceT = TypeVar("PieceT", bound=BlockJob)


@attrs.define(eq=False)
class LoadJob(Generic[PieceT]):
    """A load job in flight: its pieces, how many have not ended, what failed so far.

    `remaining` starts at one for the submission itself, so the job
    cannot end before its last piece is submitted (`LoadLedger.submitted`).
    """

    job_id: int
    deadline: float
    pieces: list[PieceT] = attrs.field(factory=list)
    remaining: int = 1
    failed: set[int] = attrs.field(factory=set)


class LoadLedger(Generic[PieceT]):
    """A handler's load jobs in flight, and those ended but not yet reported by `poll`.

    `counters` gets `load_errors` and `load_timeouts` for the blocks of
    pieces given up on at their deadline, warned about (rate-limited, through
    `warn`) with `label` before the message. `after_abandon(piece)` runs
    for each piece given up on (see the module). The handler calls
    `begin`, `add` and `submitted` as it submits a job, and
    `piece_ended` from a piece that ended by itself.
    """

    def __init__(
        self,
        *,
        counters: Counters,
        warn: RateLimitedWarning,
        label: str,
        transfer_timeout_s: float,
        after_abandon: Callable[[PieceT], None] | None = None,
    ) -> None:
        self._counters = counters
        self._warn = warn
        self._label = label
        self._transfer_timeout_s = transfer_timeout_s
        self._after_abandon = after_abandon
        self._lock = threading.Lock()
        self._running: dict[int, LoadJob[PieceT]] = {}
        self._ended: list[JobResult] = []

    # ------------------------------------------------------------ submitting

    def begin(self, job_id: int, deadline: float) -> LoadJob[PieceT]:
        """The load job `job_id`, to add pieces to."""
        job: LoadJob[PieceT] = LoadJob(job_id, deadline)
        with self._lock:
            self._running[job_id] = job
        return job

    def add(self, job: LoadJob[PieceT], piece: PieceT) -> None:
        """`piece` is one of `job`'s; add it before submitting it."""
        with self._lock:
            job.pieces.append(piece)
            job.remaining += 1

    def submitted(self, job: LoadJob[PieceT]) -> None:
        """Every piece of `job` is submitted: it ends once they all ended."""
        self._count_down(job, ())

    def piece_ended(self, job: LoadJob[PieceT], piece: PieceT) -> None:
        """`piece` of `job` ended by itself (its `end()` won): its failures count."""
        self._count_down(job, piece.failed)

    def _count_down(self, job: LoadJob[PieceT], failed: Iterable[int]) -> None:
        with self._lock:
            if self._running.get(job.job_id) is not job:
                return  # given up on at its deadline, and reported then
            job.failed.update(failed)
            job.remaining -= 1
            if job.remaining <= 0:
                self._finish(job)

    def _finish(self, job: LoadJob[PieceT]) -> None:
        """Under the lock: `job` ended; `take_ended` reports it."""
        del self._running[job.job_id]
        self._ended.append(JobResult(job.job_id, frozenset(job.failed)))

    # ------------------------------------------------------------- reporting

    def is_running(self, job_id: int) -> bool:
        """Whether the load job `job_id` has not ended."""
        with self._lock:
            return job_id in self._running

    def take_ended(self) -> list[JobResult]:
        """The jobs ended since the last call; those past their deadline are given up on first."""
        now = time.monotonic()
        with self._lock:
            overdue = [
                job
                for job in self._running.values()
                if job.deadline <= now or any(piece.never_ran() for piece in job.pieces)
            ]
        for job in overdue:
            self._give_up(job)
        with self._lock:
            ended, self._ended = self._ended, []
        return ended

    # --------------------------------------------------------------- waiting

    def wait(self, job_ids: Iterable[int], until: float | None = None) -> bool:
        """Wait for these jobs up to their deadlines (or `until`); whether they all ended.

        A job still running at its deadline (or whose pieces never ran) is
        given up on; one still running at `until`, before its deadline, is not.
        """
        wanted = set(job_ids)
        with self._lock:
            jobs = [job for job_id, job in self._running.items() if job_id in wanted]
        if not jobs:
            return True
        _wait_for_pieces(jobs, until)
        now = time.monotonic()
        for job in jobs:
            if until is None or job.deadline <= now or any(p.never_ran() for p in job.pieces):
                self._give_up(job)
        with self._lock:
            return wanted.isdisjoint(self._running)

    def end_all(self, until: float | None = None) -> None:
        """At shutdown: wait for every job up to its deadline (or `until`), then give up on it."""
        with self._lock:
            jobs = list(self._running.values())
        if not jobs:
            return
        _wait_for_pieces(jobs, until)
        for job in jobs:
            self._give_up(job)

    def count_ended(self, piece: PieceT, loaded: int, payload_bytes: int, started: float) -> None:
        """Count a piece that ended by itself: `loaded` blocks of `payload_bytes` each.

        Its blocks not loaded (`failed`)
        count as load errors; `started` is its `time.perf_counter()` at start.
        """
        self._counters.add_many(
            {
                "blocks_loaded": loaded,
                "bytes_loaded": loaded * payload_bytes,
                "load_errors": len(piece.failed),
                "load_seconds": time.perf_counter() - started,
            }
        )

    # ------------------------------------------------------------- giving up

    def _give_up(self, job: LoadJob[PieceT]) -> None:
        """End `job` now, every block of a piece given up on failed.

        Should `after_abandon` raise, every piece is still given up on, the
        job stays running (its blocks kept) and the error is raised; a later
        call ends it.
        """
        with self._lock:
            pieces = list(job.pieces)
        abandoned, late = self._abandon(pieces)
        if late is not None:
            raise late
        with self._lock:
            if self._running.get(job.job_id) is not job:
                return  # its last piece ended meanwhile
            for piece in pieces:
                job.failed.update(piece.block_ids if piece in abandoned else piece.failed)
            self._finish(job)

    def _abandon(self, pieces: Sequence[PieceT]) -> tuple[set[PieceT], Exception | None]:
        """Give up on each of `pieces` not ended; those given up on, now or before, and an error.

        Every piece is given up on before any error is raised: a piece after
        one whose `after_abandon` raised must not go on writing into the
        cache. The first error is returned, for the caller to raise once it
        has recorded the pieces.
        """
        abandoned: set[PieceT] = set()
        late: Exception | None = None
        overdue = 0
        for piece in pieces:
            try:
                if piece.abandon():
                    overdue += len(piece.block_ids)
                    abandoned.add(piece)
                    if self._after_abandon is not None:
                        self._after_abandon(piece)
                elif piece.abandoned:
                    # Given up on before (by a call that raised): its blocks never
                    # loaded, whatever it left in its failures.
                    abandoned.add(piece)
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


def _wait_for_pieces(jobs: Sequence[LoadJob[Any]], until: float | None) -> None:
    """Wait for every piece of `jobs` to end, up to the last job's deadline (or `until`)."""
    deadline = max(job.deadline for job in jobs)
    if until is not None:
        deadline = min(deadline, until)
    concurrent.futures.wait(
        [piece.future for job in jobs for piece in job.pieces if piece.future is not None],
        timeout=max(0.0, deadline - time.monotonic()),
    )
