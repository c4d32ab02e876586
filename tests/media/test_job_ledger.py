"""The jobs every transfer handler keeps, loads and saves alike: pieces, deadlines, giving up.

Real pieces on real threads ([`IOThreads`][kvwire.media.IOThreads]); a piece
"moves" its blocks by waiting for an event, so a test decides when it ends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence, Set
from concurrent.futures import Future
from typing import Any

import pytest

from kvwire.blocks.transfers import BlockTransfer
from kvwire.media import (
    Counters,
    IOThreads,
    JobLedger,
    JobPiece,
    JobResult,
    RateLimitedWarning,
    TransferHandler,
    TransferJob,
    TransferKind,
)
from tests.support.waits import TEST_LIMIT_S, returns_within, wait_until

logger = logging.getLogger(__name__)

LOAD, SAVE = TransferKind.LOAD, TransferKind.SAVE


@pytest.fixture
def threads() -> Iterator[IOThreads]:
    pool = IOThreads(2, "test-ledger")
    yield pool
    pool.shutdown()


def _ledger(counters: Counters, timeout_s: float = 0.1, **kwargs: object) -> JobLedger[JobPiece]:
    return JobLedger(
        counters=counters,
        warn=RateLimitedWarning(logger),
        label="test: ",
        transfer_timeout_s=timeout_s,
        **kwargs,  # type: ignore[arg-type]
    )


def _piece(job_id: int, deadline: float, *block_ids: int, request_id: str = "r") -> JobPiece:
    transfer = BlockTransfer(
        request_id=request_id,
        block_ids=block_ids,
        block_hashes=tuple(bytes([b]) * 32 for b in block_ids),
    )
    return JobPiece(job_id, (transfer,), deadline)


def _start(
    ledger: JobLedger[JobPiece],
    threads: IOThreads,
    piece: JobPiece,
    go_on: threading.Event,
    failed: Sequence[int] = (),
) -> None:
    def move(piece: JobPiece) -> None:
        go_on.wait(TEST_LIMIT_S)
        with piece.lock:
            piece.check()
        piece.failed = list(failed)
        piece.end()

    ledger.start(piece, threads, move)


def _begin(ledger: JobLedger[JobPiece], job_id: int, kind: TransferKind) -> float:
    return ledger.begin(TransferJob(job_id, kind, ()))


def _done() -> threading.Event:
    event = threading.Event()
    event.set()
    return event


def test_a_load_past_its_deadline_fails_every_block_of_its_running_pieces_and_is_counted(
    threads: IOThreads,
) -> None:
    counters = Counters()
    ledger = _ledger(counters)
    stuck = threading.Event()
    deadline = _begin(ledger, 7, LOAD)
    slow, quick = _piece(7, deadline, 0, 1), _piece(7, deadline, 2, 3)
    _start(ledger, threads, slow, stuck)
    _start(ledger, threads, quick, _done(), (3,))
    ledger.submitted(7)

    assert returns_within(5, lambda: ledger.wait([7]))

    # The overdue piece's every block, the ended piece's failures.
    assert ledger.poll() == [JobResult(7, frozenset({0, 1, 3}))]
    assert slow.abandoned and quick.ended
    taken = counters.take()
    assert taken["load_errors"] == 2 and taken["load_timeouts"] == 2
    assert ledger.poll() == []  # reported once
    stuck.set()


def test_a_save_past_its_deadline_is_counted_failed_and_ends_with_no_failed_blocks(
    threads: IOThreads,
) -> None:
    counters = Counters()
    ledger = _ledger(counters)
    stuck = threading.Event()
    deadline = _begin(ledger, 2, SAVE)
    slow, quick = _piece(2, deadline, 0, 1, 2), _piece(2, deadline, 3)
    _start(ledger, threads, slow, stuck)
    _start(ledger, threads, quick, _done())
    ledger.submitted(2)

    assert returns_within(5, lambda: ledger.wait([2]))

    assert ledger.poll() == [JobResult(2)]
    assert slow.abandoned and not slow.released and quick.ended
    taken = counters.take()
    assert taken["save_errors"] == 3 and taken["save_timeouts"] == 3
    assert "load_timeouts" not in taken
    stuck.set()


@pytest.mark.parametrize("kind", [LOAD, SAVE])
def test_a_job_ends_only_once_submitted_and_every_piece_ended(
    threads: IOThreads, kind: TransferKind
) -> None:
    ledger = _ledger(Counters(), TEST_LIMIT_S)
    deadline = _begin(ledger, 3, kind)
    first, second = threading.Event(), threading.Event()
    pieces = [_piece(3, deadline, 0), _piece(3, deadline, 1)]
    _start(ledger, threads, pieces[0], first)
    _start(ledger, threads, pieces[1], second, (1,))
    first.set()
    second.set()
    wait_until(ledger.idle, "both pieces to end")

    # Not submitted yet: a job whose last piece is not submitted has not ended.
    assert ledger.poll() == []
    assert ledger.is_running(3)
    ledger.submitted(3)

    # A save's failures are counted, never reported: the engine recomputes no saved block.
    failed = frozenset({1}) if kind is LOAD else frozenset()
    assert ledger.poll() == [JobResult(3, failed)]
    assert not ledger.is_running(3)
    assert ledger.poll() == []


@pytest.mark.parametrize("kind", [LOAD, SAVE])
def test_an_overdue_job_is_given_up_on_when_polled(threads: IOThreads, kind: TransferKind) -> None:
    counters = Counters()
    ledger = _ledger(counters)
    deadline = _begin(ledger, 1, kind)
    stuck = threading.Event()
    slow, quick = _piece(1, deadline, 4, 5), _piece(1, deadline, 6)
    _start(ledger, threads, slow, stuck)
    _start(ledger, threads, quick, _done())
    ledger.submitted(1)

    ended = wait_until(ledger.poll, "the overdue job to end")

    assert ended == [JobResult(1, frozenset({4, 5}) if kind is LOAD else frozenset())]
    assert counters.take()[f"{kind.value}_timeouts"] == 2
    stuck.set()


@pytest.mark.parametrize("kind", [LOAD, SAVE])
def test_an_after_abandon_error_is_raised_once_every_piece_was_given_up_on(
    threads: IOThreads, kind: TransferKind
) -> None:
    closed: list[JobPiece] = []

    def close_gate(piece: JobPiece) -> None:
        closed.append(piece)
        if len(closed) == 1:
            raise OSError("a read still in a system call")

    ledger = _ledger(Counters(), 0.05, after_abandon=close_gate)
    stuck = threading.Event()
    deadline = _begin(ledger, 0, kind)
    pieces = [_piece(0, deadline, 0), _piece(0, deadline, 1)]
    for piece in pieces:
        _start(ledger, threads, piece, stuck)
    ledger.submitted(0)

    with pytest.raises(OSError, match="system call"):
        ledger.wait([0])

    assert sorted(closed, key=id) == sorted(pieces, key=id)  # both gates closed first
    assert all(piece.abandoned for piece in pieces)
    # Still running (its blocks kept) until a later call ends it, every block failed.
    assert ledger.is_running(0)
    assert ledger.poll() == [JobResult(0, frozenset({0, 1}) if kind is LOAD else frozenset())]
    stuck.set()


@pytest.mark.parametrize("kind", [LOAD, SAVE])
def test_a_wait_until_before_the_deadline_gives_nothing_up(
    threads: IOThreads, kind: TransferKind
) -> None:
    ledger = _ledger(Counters(), TEST_LIMIT_S)
    stuck = threading.Event()
    deadline = _begin(ledger, 5, kind)
    piece = _piece(5, deadline, 7)
    _start(ledger, threads, piece, stuck)
    ledger.submitted(5)

    assert not ledger.wait([5, 99], until=time.monotonic() + 0.05)

    assert ledger.is_running(5) and not piece.abandoned
    stuck.set()
    assert ledger.wait([5])
    assert ledger.poll() == [JobResult(5)]


def test_a_release_stops_the_saves_reading_those_blocks_or_requests_and_only_them(
    threads: IOThreads,
) -> None:
    counters = Counters()
    gates_closed: list[JobPiece] = []
    settled: list[JobPiece] = []
    ledger = _ledger(
        counters, TEST_LIMIT_S, after_abandon=gates_closed.append, on_settled=settled.append
    )
    stuck = threading.Event()
    deadline = _begin(ledger, 1, SAVE)
    by_block = _piece(1, deadline, 0, 1, request_id="a")
    by_request = _piece(1, deadline, 2, request_id="b")
    other = _piece(1, deadline, 3, request_id="c")
    for piece in (by_block, by_request, other):
        _start(ledger, threads, piece, stuck)
    ledger.submitted(1)
    load_deadline = _begin(ledger, 2, LOAD)
    load = _piece(2, load_deadline, 1, request_id="b")
    _start(ledger, threads, load, stuck)
    ledger.submitted(2)

    stopped = ledger.release_saves_reading(["b"], {1})

    assert set(stopped) == {by_block, by_request}
    assert all(piece.released and piece.abandoned for piece in stopped)
    assert set(gates_closed) == set(stopped) == set(settled)
    assert not other.abandoned and not load.abandoned  # a load is never released
    assert ledger.release_saves_reading(["b"], {1}) == []  # stopped once
    assert "save_timeouts" not in counters.take()  # the handler counts releases
    stuck.set()
    assert ledger.wait([1, 2])
    # A release fails no block of the job: its result is a save's.
    assert sorted(ledger.poll(), key=lambda r: r.job_id) == [JobResult(1), JobResult(2)]
    assert settled.count(by_block) == 1 and other in settled


def test_each_piece_settles_once_whichever_way_it_ended(threads: IOThreads) -> None:
    settled: list[JobPiece] = []
    ledger = _ledger(Counters(), 0.1, on_settled=settled.append)
    stuck = threading.Event()
    deadline = _begin(ledger, 4, SAVE)
    slow, quick = _piece(4, deadline, 0), _piece(4, deadline, 1)
    _start(ledger, threads, slow, stuck)
    _start(ledger, threads, quick, _done())
    ledger.submitted(4)
    assert ledger.wait([4])

    stuck.set()
    wait_until(ledger.idle, "the given-up piece to leave its thread")

    assert sorted(settled, key=id) == sorted([slow, quick], key=id)


def test_a_job_whose_piece_never_ran_is_given_up_on_without_waiting_for_its_deadline() -> None:
    counters = Counters()
    ledger = _ledger(counters, TEST_LIMIT_S)
    pool = IOThreads(1, "test-ledger-one")
    stuck = threading.Event()
    deadline = _begin(ledger, 6, LOAD)
    running, queued = _piece(6, deadline, 0), _piece(6, deadline, 1)
    _start(ledger, pool, running, stuck)
    _start(ledger, pool, queued, stuck)
    ledger.submitted(6)

    pool.shutdown()  # cancels the queued piece
    assert queued.never_ran()
    assert returns_within(5, lambda: ledger.wait([6]))

    assert ledger.poll() == [JobResult(6, frozenset({0, 1}))]
    assert counters.take()["load_timeouts"] == 2
    stuck.set()
    wait_until(ledger.idle, "the running piece to leave its thread")


def test_end_all_waits_until_its_time_then_gives_up_every_job(threads: IOThreads) -> None:
    counters = Counters()
    ledger = _ledger(counters, TEST_LIMIT_S)
    stuck = threading.Event()
    for job_id, kind in ((1, LOAD), (2, SAVE)):
        _start(ledger, threads, _piece(job_id, _begin(ledger, job_id, kind), job_id), stuck)
        ledger.submitted(job_id)

    assert not returns_within(5, lambda: ledger.end_all(until=time.monotonic() + 0.05))

    assert sorted(ledger.poll(), key=lambda r: r.job_id) == [
        JobResult(1, frozenset({1})),
        JobResult(2),
    ]
    taken = counters.take()
    assert taken["load_timeouts"] == 1 and taken["save_timeouts"] == 1
    stuck.set()


def test_a_piece_off_its_thread_but_not_ended_is_waited_for_until_its_deadline_without_spinning(
    threads: IOThreads, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = _ledger(Counters(), 0.2)
    deadline = _begin(ledger, 8, LOAD)
    # Its work returns without ending it, as a load whose read may still write does.
    piece = _piece(8, deadline, 0)
    ledger.start(piece, threads, lambda piece: None)
    ledger.submitted(8)
    wait_until(ledger.idle, "the piece to leave its thread")
    rounds = 0
    give_up_overdue = ledger.give_up_overdue

    def counted(*args: Any, **kwargs: Any) -> None:
        nonlocal rounds
        rounds += 1
        give_up_overdue(*args, **kwargs)

    monkeypatch.setattr(ledger, "give_up_overdue", counted)

    assert ledger.wait([8])

    assert time.monotonic() >= deadline and piece.abandoned
    assert rounds <= 3
    assert ledger.poll() == [JobResult(8, frozenset({0}))]


class _EndsWhenAsked(Future[None]):
    """A future whose work runs the first time someone asks whether it is done.

    It puts a piece's end exactly between the ledger's look at its jobs and its
    look at their futures, where a real thread may end it at any time.
    """

    def __init__(self, work: Callable[[], None]) -> None:
        super().__init__()
        self._work: Callable[[], None] | None = work

    def done(self) -> bool:
        if self._work is not None:
            work, self._work = self._work, None
            work()
            self.set_result(None)
        return super().done()


class _AskedThreads:
    def submit(self, fn: Callable[..., None], *args: Any) -> Future[None]:
        return _EndsWhenAsked(lambda: fn(*args))


def test_a_wait_whose_jobs_end_while_it_looks_returns_without_sleeping_to_their_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ledger = _ledger(Counters(), TEST_LIMIT_S)
    piece = _piece(9, _begin(ledger, 9, SAVE), 0)
    ledger.start(piece, _AskedThreads(), lambda piece: piece.end())  # type: ignore[arg-type]
    ledger.submitted(9)

    def slept(seconds: float) -> None:
        raise AssertionError(f"wait slept {seconds:.1f} s for a job that had ended")

    monkeypatch.setattr(time, "sleep", slept)

    assert ledger.wait([9])
    assert ledger.poll() == [JobResult(9)]


class _Runner(TransferHandler):
    """Another handler, running the jobs handed to it until a test ends them."""

    def __init__(self) -> None:
        self.jobs: dict[int, TransferJob] = {}
        self.done: dict[int, threading.Event] = {}
        self._ended: list[JobResult] = []
        self._lock = threading.Lock()

    def submit(self, job: TransferJob) -> None:
        self.jobs[job.job_id] = job
        self.done[job.job_id] = threading.Event()

    def end(self, job_id: int, failed: frozenset[int] = frozenset()) -> None:
        with self._lock:
            self._ended.append(JobResult(job_id, failed))
        self.done[job_id].set()

    def poll(self) -> list[JobResult]:
        with self._lock:
            ended, self._ended = self._ended, []
        return ended

    def wait(self, job_ids: Iterable[int], until: float | None = None) -> bool:
        limit = TEST_LIMIT_S if until is None else max(0.0, until - time.monotonic())
        return all(self.done[job_id].wait(limit) for job_id in job_ids)

    def release_saves_reading(
        self, request_ids: Iterable[str], block_ids: Set[int]
    ) -> list[BlockTransfer]:
        return []

    def close(self) -> None:
        pass


def _delegate(
    ledger: JobLedger[JobPiece], runner: _Runner, job_id: int, kind: TransferKind, *blocks: int
) -> tuple[JobPiece, int]:
    """A job of one piece over `blocks`, delegated to `runner`; the piece, the runner's job id."""
    piece = _piece(job_id, _begin(ledger, job_id, kind), *blocks)
    ledger.delegate(piece, runner)
    ledger.submitted(job_id)
    (runner_job_id,) = [i for i, job in runner.jobs.items() if job.transfers == piece.transfers]
    return piece, runner_job_id


def test_a_delegated_piece_runs_as_the_runners_own_job_and_ends_when_the_runner_reports_it() -> (
    None
):
    counters, runner = Counters(), _Runner()
    ledger = _ledger(counters)
    piece, runner_job_id = _delegate(ledger, runner, 1, LOAD, 4, 5, 6)
    assert runner.jobs[runner_job_id].kind is LOAD
    assert ledger.poll() == []
    assert ledger.is_running(1)
    runner.end(runner_job_id, frozenset({5}))
    assert ledger.poll() == [JobResult(1, frozenset({5}))]
    assert piece.ended and set(piece.failed) == {5}
    assert ledger.idle()  # it never took a thread of this ledger's handler


def test_a_delegated_piece_past_its_deadline_is_its_runners_to_give_up_not_the_ledgers() -> None:
    counters, runner = Counters(), _Runner()
    ledger = _ledger(counters, timeout_s=0.01)
    _, runner_job_id = _delegate(ledger, runner, 1, SAVE, 4, 5)
    time.sleep(0.02)
    assert ledger.poll() == []  # past its deadline here, still running on its runner
    assert ledger.is_running(1)
    assert ledger.release_saves_reading(["r"], {4}) == []  # its runner releases it
    assert not ledger.wait([1], time.monotonic() + 0.05)
    assert counters.take() == {}  # the runner counts its own jobs
    threading.Timer(0.05, runner.end, (runner_job_id,)).start()
    assert returns_within(5, lambda: ledger.wait([1])) is True
    assert ledger.poll() == [JobResult(1)]


def test_jobs_moving_names_the_jobs_with_a_piece_over_those_blocks() -> None:
    runner = _Runner()
    ledger = _ledger(Counters())
    _delegate(ledger, runner, 1, SAVE, 1, 2)
    _, load_job = _delegate(ledger, runner, 2, LOAD, 2, 3)
    assert sorted(ledger.jobs_moving([2])) == [1, 2]
    assert ledger.jobs_moving([3, 9], LOAD) == [2]
    assert ledger.jobs_moving([1], LOAD) == []
    runner.end(load_job)
    ledger.poll()
    assert ledger.jobs_moving([2, 3]) == [1]


def test_a_wait_past_its_until_still_asks_the_runner_whether_its_job_ended() -> None:
    runner = _Runner()
    ledger = _ledger(Counters())
    _, runner_job_id = _delegate(ledger, runner, 1, SAVE, 4)
    assert not ledger.wait([1], time.monotonic() - 1)
    runner.end(runner_job_id)
    assert ledger.wait([1], time.monotonic() - 1)
    assert not ledger.is_running(1)
