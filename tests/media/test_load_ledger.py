"""The load jobs every transfer handler keeps: pieces, deadlines, giving up, outcomes.

Real jobs on real threads (:class:`~kvwire.media._job_threads.JobThreads`);
a job "loads" by waiting for an event, so a test decides when it ends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence

import pytest

from kvwire.interface.counters import Counters
from kvwire.media._job_threads import JobThreads
from kvwire.media._load_ledger import LoadJob, LoadLedger
from kvwire.media._rate_limited import RateLimitedWarning
from kvwire.media._transfer_jobs import BlockJob
from kvwire.media.base import JobResult
from tests.support.waits import TEST_LIMIT_S, returns_within, wait_until

logger = logging.getLogger(__name__)


@pytest.fixture
def threads() -> Iterator[JobThreads]:
    pool = JobThreads(2, "test-ledger")
    yield pool
    pool.shutdown()


def _ledger(counters: Counters, **kwargs: object) -> LoadLedger[BlockJob]:
    return LoadLedger(
        counters=counters,
        warn=RateLimitedWarning(logger),
        label="test: ",
        transfer_timeout_s=0.1,
        **kwargs,  # type: ignore[arg-type]
    )


def _run(
    ledger: LoadLedger[BlockJob],
    threads: JobThreads,
    load_job: LoadJob[BlockJob],
    piece: BlockJob,
    go_on: threading.Event,
    failed: Sequence[int] = (),
) -> None:
    def load() -> None:
        go_on.wait(TEST_LIMIT_S)
        piece.failed = list(failed)
        if piece.end():
            ledger.piece_ended(load_job, piece)

    ledger.add(load_job, piece)
    piece.future = threads.submit(load)


def test_a_job_past_its_deadline_fails_every_block_of_its_running_pieces_and_is_counted(
    threads: JobThreads,
) -> None:
    counters = Counters()
    ledger = _ledger(counters)
    stuck, done = threading.Event(), threading.Event()
    done.set()
    load_job = ledger.begin(7, time.monotonic() + 0.1)
    slow, quick = BlockJob(load_job.deadline, (0, 1)), BlockJob(load_job.deadline, (2, 3))
    _run(ledger, threads, load_job, slow, stuck)
    _run(ledger, threads, load_job, quick, done, (3,))
    ledger.submitted(load_job)

    assert returns_within(5, lambda: ledger.wait([7]))

    # The overdue piece's every block, the ended piece's failures.
    assert ledger.take_ended() == [JobResult(7, frozenset({0, 1, 3}))]
    assert slow.abandoned and quick.ended
    taken = counters.take()
    assert taken["load_errors"] == 2 and taken["load_timeouts"] == 2
    assert ledger.take_ended() == []  # reported once
    stuck.set()


def test_a_job_ends_only_once_submitted_and_every_piece_ended(threads: JobThreads) -> None:
    ledger = _ledger(Counters())
    load_job = ledger.begin(3, time.monotonic() + TEST_LIMIT_S)
    first, second = threading.Event(), threading.Event()
    pieces = [BlockJob(load_job.deadline, (0,)), BlockJob(load_job.deadline, (1,))]
    _run(ledger, threads, load_job, pieces[0], first)
    _run(ledger, threads, load_job, pieces[1], second, (1,))
    first.set()
    wait_until(lambda: pieces[0].ended, "the first piece to end")
    second.set()
    wait_until(lambda: pieces[1].ended, "the second piece to end")

    # Not submitted yet: a job whose last piece is not submitted has not ended.
    assert ledger.take_ended() == []
    assert ledger.is_running(3)
    ledger.submitted(load_job)

    assert ledger.take_ended() == [JobResult(3, frozenset({1}))]
    assert not ledger.is_running(3)
    assert ledger.take_ended() == []


def test_an_overdue_job_is_given_up_on_when_the_ended_jobs_are_taken(
    threads: JobThreads,
) -> None:
    counters = Counters()
    ledger = _ledger(counters)
    load_job = ledger.begin(1, time.monotonic() + 0.1)
    stuck, done = threading.Event(), threading.Event()
    done.set()
    slow, quick = BlockJob(load_job.deadline, (4, 5)), BlockJob(load_job.deadline, (6,))
    _run(ledger, threads, load_job, slow, stuck)
    _run(ledger, threads, load_job, quick, done)
    ledger.submitted(load_job)

    ended = wait_until(ledger.take_ended, "the overdue job to end")

    assert ended == [JobResult(1, frozenset({4, 5}))]
    assert counters.take()["load_timeouts"] == 2
    stuck.set()


def test_an_after_abandon_error_is_raised_once_every_piece_was_given_up_on(
    threads: JobThreads,
) -> None:
    closed: list[BlockJob] = []

    def close_gate(piece: BlockJob) -> None:
        closed.append(piece)
        if len(closed) == 1:
            raise OSError("a read still in a system call")

    ledger = _ledger(Counters(), after_abandon=close_gate)
    stuck = threading.Event()
    load_job = ledger.begin(0, time.monotonic() + 0.05)
    pieces = [BlockJob(load_job.deadline, (0,)), BlockJob(load_job.deadline, (1,))]
    for piece in pieces:
        _run(ledger, threads, load_job, piece, stuck)
    ledger.submitted(load_job)

    with pytest.raises(OSError, match="system call"):
        ledger.wait([0])

    assert closed == pieces  # the second piece's gate closed too, before the error
    assert all(piece.abandoned for piece in pieces)
    # Still running (its blocks kept) until a later call ends it, every block failed.
    assert ledger.is_running(0)
    assert ledger.take_ended() == [JobResult(0, frozenset({0, 1}))]
    stuck.set()


def test_a_wait_until_before_the_deadline_gives_nothing_up(threads: JobThreads) -> None:
    ledger = _ledger(Counters())
    stuck = threading.Event()
    load_job = ledger.begin(5, time.monotonic() + TEST_LIMIT_S)
    piece = BlockJob(load_job.deadline, (7,))
    _run(ledger, threads, load_job, piece, stuck)
    ledger.submitted(load_job)

    assert not ledger.wait([5, 99], until=time.monotonic() + 0.05)

    assert ledger.is_running(5) and not piece.abandoned
    stuck.set()
    assert ledger.wait([5])
    assert ledger.take_ended() == [JobResult(5, frozenset())]
