"""A transfer handler's jobs in flight: their pieces on its I/O threads, deadlines, giving up.

A handler splits each `kvwire.media.TransferJob` into pieces
(`kvwire.media.JobPiece`: blocks that one I/O thread moves)
and hands them to a `kvwire.media.JobLedger`, which keeps
the rest, the same for loads and saves: which pieces of each job have not
ended, when the job ends (its last piece ended), giving up on it at its
deadline (`transfer_timeout_s` from its submission: every block of a piece
still running then failed, counted and warned about), waiting for some jobs,
stopping the saves that read blocks about to be written (a release), and
which jobs ended since the handler last reported
(`kvwire.media.TransferHandler.poll`). What a handler keeps itself is
how bytes move.

A piece given up on (at its deadline, or released) writes nothing more where
its caller could see it: it moves bytes only under its `lock` after `check`,
and `kvwire.media.JobPiece.abandon` takes that lock.
A medium whose writes are system calls the lock cannot stop closes its own
gate in `after_abandon` (which may raise, as
`kvwire.media.LateWriteError` does; every piece is still
given up on first, and a later call ends the job).

A piece may also run on another handler: the ledger hands it to that
handler (its runner) as a job of the runner's own
(`kvwire.media.JobLedger.delegate`), and the runner moves its
bytes on its own threads, drops or gives it up and counts it, as it does its
other jobs. The ledger still tracks it as a piece of its job, and settles it
when the runner reports that job ended: a medium built over another (the
tiered medium over its tiers) tracks the jobs it hands over as it tracks its
own, without a thread of its own waiting on each.

Which request a job serves and which engine step waits for it is the
connector's bookkeeping (`kvwire.connectors.offload.transfer_book`), over every
handler's ledger alike.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Generic, TypeVar

import attrs

from kvwire.blocks.transfers import BlockTransfer
from kvwire.exceptions import JobAbandoned
from kvwire.interface.counters import Counters
from kvwire.media.base import JobResult, TransferHandler, TransferJob, TransferKind
from kvwire.media.io_threads import IOThreads
from kvwire.media.rate_limited import RateLimitedWarning

__all__ = ["JobLedger", "JobPiece", "part_of"]


class JobPiece:
    """Blocks of one transfer job that one I/O thread moves, and who settled them.

    `transfers` are the piece's blocks (a part of one of the job's
    transfers, or several whole ones); `block_ids` all of their block ids,
    in order. The piece ends itself (`end`) or its caller gives up on it
    (`abandon`); exactly one of them wins, under `lock`. The
    piece's thread writes where the caller can see it only under `lock`
    after `check`, so once a give-up has returned, no such write is under way
    or starts. `failed` is a load piece's to set before it ends: the block
    ids it did not load. `runner` is the handler running a delegated piece
    (none for a piece on its ledger's own threads).
    """

    def __init__(self, job_id: int, transfers: Sequence[BlockTransfer], deadline: float) -> None:
        self.job_id = job_id
        self.transfers = tuple(transfers)
        self.block_ids: tuple[int, ...] = tuple(
            block_id for transfer in self.transfers for block_id in transfer.block_ids
        )
        self.deadline = deadline
        self.lock = threading.Lock()
        self.abandoned = False
        # Given up on because its blocks are about to be written (not its deadline).
        self.released = False
        self.ended = False
        self.failed: Sequence[int] = ()
        self.future: Future[None] | None = None
        self.runner: TransferHandler | None = None

    def check(self) -> None:
        """Raise `kvwire.exceptions.JobAbandoned` if given up on; hold `lock`."""
        if self.abandoned:
            raise JobAbandoned

    def abandon(self, *, released: bool = False) -> bool:
        """Give up on the piece unless it has ended; whether it was given up on now.

        `released`: because its blocks are about to be written, not at its
        deadline. Waits at most for a write under way under `lock` (a memory
        copy), never for the piece's I/O.
        """
        with self.lock:
            if self.ended or self.abandoned:
                return False
            self.abandoned = True
            self.released = released
        # A piece still queued never runs; one already running notices the flag.
        if self.future is not None:
            self.future.cancel()
        return True

    def never_ran(self) -> bool:
        """Whether the piece was given up on before it started (its resources are the caller's)."""
        return self.future is not None and self.future.cancelled()

    def end(self) -> bool:
        """Mark the piece ended; False if its caller gave up on it first."""
        with self.lock:
            if self.abandoned:
                return False
            self.ended = True
            return True

    def reads(self, request_ids: set[str], block_ids: set[int]) -> bool:
        """Whether the piece moves blocks of any of `request_ids`, or any of `block_ids`."""
        return any(t.request_id in request_ids for t in self.transfers) or not (
            block_ids.isdisjoint(self.block_ids)
        )


def part_of(transfer: BlockTransfer, start: int, stop: int) -> BlockTransfer:
    """The blocks `start:stop` of `transfer`, with their slots and their payload's records."""
    payload = transfer.payload
    return attrs.evolve(
        transfer,
        block_ids=transfer.block_ids[start:stop],
        block_hashes=transfer.block_hashes[start:stop],
        slots=transfer.slots[start:stop],
        payload=None if payload is None else payload.part(start, stop),
    )


PieceT = TypeVar("PieceT", bound=JobPiece)


@attrs.define(eq=False)
class _JobInFlight(Generic[PieceT]):
    """A job in flight: its pieces not settled yet, and its failed block ids so far.

    `submitting` holds the job open until its last piece is submitted
    (`JobLedger.submitted`).
    """

    job_id: int
    kind: TransferKind
    deadline: float
    running: set[PieceT] = attrs.field(factory=set)
    submitting: bool = True
    failed: set[int] = attrs.field(factory=set)


class JobLedger(Generic[PieceT]):
    """A handler's jobs in flight, loads and saves, and those ended but not yet polled.

    Given up on at their deadline, pieces count as `load_errors` and
    `load_timeouts` (or `save_errors` and `save_timeouts`) in `counters`,
    and are warned about (rate-limited, through `warn`) with `label`
    before the message. `after_abandon(piece)` runs for each piece given up
    on or released (see the module); `on_settled(piece)` once for each
    piece the ledger stops tracking (ended, given up on, released), outside
    the ledger's lock: a handler frees what the piece held there.

    A handler calls `begin` for each job, `start` for each piece (or
    `delegate`, for a piece another handler runs), then `submitted`; its
    pieces call `kvwire.media.JobPiece.end` and count what
    they moved (`count_load`, `count_save`).
    """

    def __init__(
        self,
        *,
        counters: Counters,
        warn: RateLimitedWarning,
        label: str,
        transfer_timeout_s: float,
        after_abandon: Callable[[PieceT], None] | None = None,
        on_settled: Callable[[PieceT], None] | None = None,
    ) -> None:
        self._counters = counters
        self._warn = warn
        self._label = label
        self.transfer_timeout_s = transfer_timeout_s
        self._after_abandon = after_abandon
        self._on_settled = on_settled
        self._lock = threading.Lock()
        self._running: dict[int, _JobInFlight[PieceT]] = {}
        self._ended: list[JobResult] = []
        # Pieces on a thread, those given up on included.
        self._on_threads = 0
        # Delegated pieces by their runner's id of their job (unique across runners).
        self._delegated: dict[int, PieceT] = {}
        self._runner_job_ids = itertools.count()

    # ------------------------------------------------------------ submitting

    def begin(self, job: TransferJob) -> float:
        """Track `job` (add its pieces with `start`, then call `submitted`); its deadline."""
        deadline = time.monotonic() + self.transfer_timeout_s
        with self._lock:
            self._running[job.job_id] = _JobInFlight(job.job_id, job.kind, deadline)
        return deadline

    def start(self, piece: PieceT, threads: IOThreads, work: Callable[[PieceT], None]) -> None:
        """Run `work(piece)` on `threads` as a piece of its job.

        `work` calls `piece.end()` once done (and counts what it moved when
        that returns True); a piece it leaves not ended is given up on at its
        deadline. `kvwire.media.JobAbandoned` out of `work`
        (from `piece.check()`) ends it quietly; anything else fails every
        block of it and is raised into its future.
        """
        with self._lock:
            job = self._running[piece.job_id]
            job.running.add(piece)
            self._on_threads += 1
        try:
            piece.future = threads.submit(self._run, piece, work)
        except BaseException:
            with self._lock:
                job.running.discard(piece)
                self._on_threads -= 1
            raise
        # A piece cancelled while queued never runs `_run`.
        piece.future.add_done_callback(self._left_thread_if_cancelled)

    def delegate(self, piece: PieceT, runner: TransferHandler) -> None:
        """Have `runner`, another handler, run `piece` as a job of its own.

        The runner moves its blocks on its own threads, and drops, releases,
        gives up on and counts that job as any of its own, at its own
        deadline; the ledger settles the piece (with the runner's `failed`)
        once the runner reports the job ended, to `poll` or to `wait`, which
        wait for the runner's jobs through its `wait`. Every result the
        runner reports is this ledger's: nothing else submits to it or polls it.
        """
        with self._lock:
            job = self._running[piece.job_id]
            runner_job_id = next(self._runner_job_ids)
            piece.runner = runner
            job.running.add(piece)
            self._delegated[runner_job_id] = piece
        try:
            runner.submit(TransferJob(runner_job_id, job.kind, piece.transfers))
        except BaseException:
            with self._lock:
                job.running.discard(piece)
                del self._delegated[runner_job_id]
            raise

    def submitted(self, job_id: int) -> None:
        """Every piece of `job_id` is started: it ends once they all settled."""
        with self._lock:
            job = self._running.get(job_id)
            if job is None:
                return
            job.submitting = False
            if not job.running:
                self._finish(job)

    def _run(self, piece: PieceT, work: Callable[[PieceT], None]) -> None:
        try:
            work(piece)
        except JobAbandoned:
            pass  # given up on: counted and reported then
        except BaseException:
            piece.failed = piece.block_ids
            piece.end()
            raise
        finally:
            # A piece `work` left not ended (still writing, as far as it knows)
            # is given up on at its deadline.
            if piece.ended:
                self._settle([piece])
            with self._lock:
                self._on_threads -= 1

    def _collect_delegated(self, runners: Iterable[TransferHandler] | None = None) -> None:
        """Settle the delegated pieces whose runners (`runners`, or all) report their jobs ended."""
        with self._lock:
            if runners is None:
                runners = [p.runner for p in self._delegated.values() if p.runner is not None]
            # Each runner once, by identity: a handler need not be hashable.
            distinct = list({id(runner): runner for runner in runners}.values())
        for runner in distinct:
            results = runner.poll()
            ended = []
            with self._lock:
                for result in results:
                    piece = self._delegated.get(result.job_id)
                    if piece is None or piece.runner is not runner:
                        continue
                    del self._delegated[result.job_id]
                    piece.failed = tuple(result.failed)
                    piece.end()  # never given up on here: its runner does that
                    ended.append(piece)
            self._settle(ended)

    def _left_thread_if_cancelled(self, future: Future[None]) -> None:
        if future.cancelled():
            with self._lock:
                self._on_threads -= 1

    def _settle(self, pieces: Iterable[PieceT]) -> None:
        """Stop tracking these pieces: ended (their `failed`), given up on (all), or released."""
        settled = []
        with self._lock:
            for piece in pieces:
                job = self._running.get(piece.job_id)
                if job is None or piece not in job.running:
                    continue
                job.running.discard(piece)
                settled.append(piece)
                if not piece.released:
                    job.failed.update(piece.block_ids if piece.abandoned else piece.failed)
                if not job.running and not job.submitting:
                    self._finish(job)
        if self._on_settled is not None:
            for piece in settled:
                self._on_settled(piece)

    def _finish(self, job: _JobInFlight[PieceT]) -> None:
        """Under the lock: `job` ended; `poll` reports it."""
        del self._running[job.job_id]
        failed = frozenset(job.failed) if job.kind is TransferKind.LOAD else frozenset()
        self._ended.append(JobResult(job.job_id, failed))

    # ------------------------------------------------------------- reporting

    def is_running(self, job_id: int) -> bool:
        """Whether the job `job_id` has not ended."""
        with self._lock:
            return job_id in self._running

    def idle(self) -> bool:
        """Whether no piece runs on any thread, pieces given up on included."""
        with self._lock:
            return self._on_threads == 0

    def poll(self) -> list[JobResult]:
        """The jobs ended since the last call, each once; those past their deadline end first.

        Delegated pieces' runners are polled first (each gives up its own
        jobs past their deadline then).
        """
        self._collect_delegated()
        self.give_up_overdue()
        with self._lock:
            ended, self._ended = self._ended, []
        return ended

    def count_load(self, piece: PieceT, loaded: int, payload_bytes: int, started: float) -> None:
        """Count a load piece that ended by itself: `loaded` blocks of `payload_bytes` each.

        Its blocks not loaded (`failed`) count as load errors; `started` is
        its `time.perf_counter()` at start.
        """
        self._counters.add_many(
            {
                "blocks_loaded": loaded,
                "bytes_loaded": loaded * payload_bytes,
                "load_errors": len(piece.failed),
                "load_seconds": time.perf_counter() - started,
            }
        )

    def count_save(self, piece: PieceT, saved: int, payload_bytes: int, started: float) -> None:
        """Count a save piece that ended by itself: `saved` of its blocks, the rest failed."""
        self._counters.add_many(
            {
                "blocks_saved": saved,
                "bytes_saved": saved * payload_bytes,
                "save_errors": len(piece.block_ids) - saved,
                "save_seconds": time.perf_counter() - started,
            }
        )

    # --------------------------------------------------------------- waiting

    def wait(self, job_ids: Iterable[int], until: float | None = None) -> bool:
        """Block until these jobs ended, or until `until` (`time.monotonic()`); whether they did.

        A job still running at its deadline (or whose pieces never ran) is
        given up on then, and counts as ended; so does an id this ledger does
        not track. Without `until` it still returns, by the last deadline (a
        delegated piece's: its runner's).
        """
        wanted = set(job_ids)
        while True:
            # First, even past `until`: a runner tells whether its jobs ended.
            self._wait_for_runners(wanted, until)
            self.give_up_overdue(wanted)
            with self._lock:
                jobs = [job for job_id, job in self._running.items() if job_id in wanted]
                futures = [p.future for job in jobs for p in job.running if p.future is not None]
                on_runners = any(p.runner is not None for job in jobs for p in job.running)
            if not jobs:
                return True
            now = time.monotonic()
            if until is not None and now >= until:
                return False
            if on_runners:
                # Its runner said it ended, and another poll took its result and
                # is settling it: look again at once.
                continue
            wake = min(job.deadline for job in jobs)
            if until is not None:
                wake = min(wake, until)
            running = [future for future in futures if not future.done()]
            if running:
                # No exception to catch: wait() reports what ended, timed out or not.
                concurrent.futures.wait(running, timeout=max(0.0, wake - now))
            elif self._left_thread_unended(wanted):
                # Off its thread but not ended (still writing, as far as its work
                # knows): nothing to wait for but its deadline.
                time.sleep(max(0.0, wake - now))
            # Otherwise the pieces seen above settled since: look again at once,
            # rather than sleep to a deadline for jobs that already ended.

    def _wait_for_runners(self, job_ids: set[int], until: float | None) -> None:
        """Wait for the runners of these jobs' delegated pieces (up to `until`), then poll them."""
        with self._lock:
            delegated = [
                (runner_job_id, piece.runner)
                for runner_job_id, piece in self._delegated.items()
                if piece.job_id in job_ids and piece.runner is not None
            ]
        if not delegated:
            return
        runners = list({id(runner): runner for _, runner in delegated}.values())
        for runner in runners:
            runner.wait([job_id for job_id, of in delegated if of is runner], until)
        self._collect_delegated(runners)

    def _left_thread_unended(self, job_ids: set[int]) -> bool:
        """Whether a piece of these jobs left its thread without settling (given up on, writing)."""
        with self._lock:
            return any(
                piece.future is not None and piece.future.done()
                for job_id, job in self._running.items()
                if job_id in job_ids
                for piece in job.running
            )

    def jobs_moving(self, block_ids: Iterable[int], kind: TransferKind | None = None) -> list[int]:
        """The jobs in flight (of `kind`, or any) with a piece moving any of `block_ids`."""
        blocks = set(block_ids)
        with self._lock:
            return [
                job.job_id
                for job in self._running.values()
                if (kind is None or job.kind is kind)
                and any(piece.reads(set(), blocks) for piece in job.running)
            ]

    def save_jobs_of(self, request_ids: Iterable[str]) -> list[int]:
        """The save jobs in flight with a piece of any of `request_ids`."""
        requests = set(request_ids)
        with self._lock:
            return [
                job.job_id
                for job in self._running.values()
                if job.kind is TransferKind.SAVE
                and any(piece.reads(requests, set()) for piece in job.running)
            ]

    def end_all(self, until: float | None = None) -> bool:
        """At shutdown: wait for every job up to its deadline (or `until`), then give up on it.

        Whether they all ended by themselves (or at their deadline) first.
        """
        with self._lock:
            job_ids = list(self._running)
        ended = self.wait(job_ids, until)
        with self._lock:
            jobs = list(self._running.values())
        self._give_up(jobs)
        return ended

    # ------------------------------------------------------------- giving up

    def give_up_overdue(
        self, job_ids: set[int] | None = None, *, kind: TransferKind | None = None
    ) -> None:
        """Give up on the jobs past their deadline or never run: of `job_ids`, `kind`, or all."""
        now = time.monotonic()
        with self._lock:
            overdue = [
                job
                for job in self._running.values()
                if (job_ids is None or job.job_id in job_ids)
                and (kind is None or job.kind is kind)
                and (job.deadline <= now or any(piece.never_ran() for piece in job.running))
            ]
        self._give_up(overdue)

    def release_saves_reading(
        self, request_ids: Iterable[str], block_ids: Iterable[int]
    ) -> list[PieceT]:
        """Give up on the save pieces reading blocks of `request_ids` or any of `block_ids`.

        Before those blocks are written: a piece not started never runs, one
        under way moves nothing more once its write under `lock` (and
        `after_abandon`) returned. Returns the pieces this call stopped, not
        those that had ended or were given up on before; the handler counts
        them. Their blocks are not the job's failures: its result is a save's.
        A delegated piece is its runner's to release.
        """
        requests, blocks = set(request_ids), set(block_ids)
        if not requests and not blocks:
            return []
        with self._lock:
            reading = [
                piece
                for job in self._running.values()
                if job.kind is TransferKind.SAVE
                for piece in job.running
                if piece.runner is None and piece.reads(requests, blocks)
            ]
        stopped = [piece for piece in reading if piece.abandon(released=True)]
        error = self._call_after_abandon(stopped)
        self._settle([piece for piece in reading if piece.abandoned])
        if error is not None:
            raise error
        return stopped

    def _give_up(self, jobs: Sequence[_JobInFlight[PieceT]]) -> None:
        """Give up on every piece of `jobs` not settled: every block of it failed.

        A delegated piece is left to its runner, which gives it up at its own
        deadline. Should `after_abandon` raise, every piece is still given up
        on, the jobs stay running (their blocks kept) and the first error is
        raised; a later call ends them.
        """
        for kind in TransferKind:
            with self._lock:
                pieces = [
                    p for job in jobs if job.kind is kind for p in job.running if p.runner is None
                ]
            now_abandoned = [piece for piece in pieces if piece.abandon()]
            self._count_given_up(kind, now_abandoned)
            error = self._call_after_abandon(now_abandoned)
            if error is not None:
                raise error
            # Given up on before too (by a call that raised): settled now.
            self._settle([piece for piece in pieces if piece.abandoned])

    def _call_after_abandon(self, pieces: Sequence[PieceT]) -> Exception | None:
        """`after_abandon` for each of `pieces`; the first error, once every piece had its call."""
        first: Exception | None = None
        if self._after_abandon is not None:
            for piece in pieces:
                try:
                    self._after_abandon(piece)
                except Exception as error:
                    first = first or error
        return first

    def _count_given_up(self, kind: TransferKind, pieces: Sequence[PieceT]) -> None:
        blocks = sum(len(piece.block_ids) for piece in pieces)
        if not blocks:
            return
        if kind is TransferKind.LOAD:
            self._counters.add_many({"load_errors": blocks, "load_timeouts": blocks})
            self._warn.warn(
                "load-timeout",
                "%sloads of %d blocks still running after %g s (transfer_timeout_s): "
                "reported as load errors, to be computed again",
                self._label,
                blocks,
                self.transfer_timeout_s,
            )
        else:
            self._counters.add_many({"save_errors": blocks, "save_timeouts": blocks})
            self._warn.warn(
                "save-timeout",
                "%ssaves of %d blocks still running after %g s (transfer_timeout_s) "
                "are counted failed",
                self._label,
                blocks,
                self.transfer_timeout_s,
            )
