"""The load bookkeeping every transfer handler shares: deadlines, give-up and the error ledger.

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
from kvwire.media._load_ledger import AsyncLoad, LoadLedger
from kvwire.media._rate_limited import RateLimitedWarning
from kvwire.media._transfer_jobs import BlockJob
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
    job: BlockJob,
    go_on: threading.Event,
    failed: Sequence[int] = (),
    state: AsyncLoad[BlockJob] | None = None,
) -> None:
    def load() -> None:
        go_on.wait(TEST_LIMIT_S)
        job.failed = list(failed)
        if job.end() and state is not None:
            ledger.job_ended(state, job)

    job.future = threads.submit(load)


def test_a_synchronous_job_past_its_deadline_fails_every_block_and_is_counted(
    threads: JobThreads,
) -> None:
    counters = Counters()
    ledger = _ledger(counters)
    stuck, done = threading.Event(), threading.Event()
    done.set()
    deadline = time.monotonic() + 0.1
    slow, quick = BlockJob(deadline, (0, 1)), BlockJob(deadline, (2, 3))
    for job, go_on, failed in ((slow, stuck, ()), (quick, done, (3,))):
        ledger.add_sync(job)
        _run(ledger, threads, job, go_on, failed)

    errors = returns_within(5, ledger.take_errors)

    assert errors == {0, 1, 3}  # the overdue job's every block, the ended job's failures
    assert slow.abandoned and quick.ended
    taken = counters.take()
    assert taken["load_errors"] == 2 and taken["load_timeouts"] == 2
    assert ledger.take_errors() == set()
    stuck.set()


def test_an_asynchronous_load_finishes_only_once_submitted_and_every_job_ended(
    threads: JobThreads,
) -> None:
    ledger = _ledger(Counters())
    state = ledger.begin_async("r", time.monotonic() + TEST_LIMIT_S)
    first, second = threading.Event(), threading.Event()
    jobs = [BlockJob(state.deadline, (0,)), BlockJob(state.deadline, (1,))]
    for job, go_on, failed in ((jobs[0], first, ()), (jobs[1], second, (1,))):
        ledger.add_async(state, job)
        _run(ledger, threads, job, go_on, failed, state)
    first.set()
    wait_until(lambda: jobs[0].ended, "the first job to end")
    second.set()
    wait_until(lambda: jobs[1].ended, "the second job to end")

    # Not submitted yet: a request whose last transfer is not submitted is not finished.
    assert ledger.take_finished() == set()
    assert ledger.is_loading("r")
    ledger.submitted(state)

    assert ledger.take_finished() == {"r"}
    assert not ledger.is_loading("r")
    assert ledger.take_errors() == {1}
    assert ledger.take_finished() == set()  # reported once


def test_an_overdue_asynchronous_load_is_reported_finished_with_its_running_jobs_failed(
    threads: JobThreads,
) -> None:
    counters = Counters()
    ledger = _ledger(counters)
    state = ledger.begin_async("r", time.monotonic() + 0.1)
    stuck, done = threading.Event(), threading.Event()
    done.set()
    slow, quick = BlockJob(state.deadline, (4, 5)), BlockJob(state.deadline, (6,))
    for job, go_on in ((slow, stuck), (quick, done)):
        ledger.add_async(state, job)
        _run(ledger, threads, job, go_on, (), state)
    ledger.submitted(state)

    assert wait_until(ledger.take_finished, "the overdue load to finish") == {"r"}
    assert ledger.take_errors() == {4, 5}
    assert counters.take()["load_timeouts"] == 2
    stuck.set()


def test_an_after_abandon_error_is_raised_once_every_job_was_given_up_on(
    threads: JobThreads,
) -> None:
    closed: list[BlockJob] = []

    def close_gate(job: BlockJob) -> None:
        closed.append(job)
        if len(closed) == 1:
            raise OSError("a read still in a system call")

    ledger = _ledger(Counters(), after_abandon=close_gate)
    stuck = threading.Event()
    deadline = time.monotonic() + 0.05
    jobs = [BlockJob(deadline, (0,)), BlockJob(deadline, (1,))]
    for job in jobs:
        ledger.add_sync(job)
        _run(ledger, threads, job, stuck)

    with pytest.raises(OSError, match="system call"):
        ledger.wait_for_sync()

    assert closed == jobs  # the second job's gate closed too, before the error
    assert all(job.abandoned for job in jobs)
    assert ledger.take_errors() == {0, 1}
    stuck.set()


def test_waiting_out_a_preempted_request_gives_its_load_up_at_its_deadline(
    threads: JobThreads,
) -> None:
    ledger = _ledger(Counters())
    state = ledger.begin_async("r", time.monotonic() + 0.1)
    stuck = threading.Event()
    job = BlockJob(state.deadline, (7,))
    ledger.add_async(state, job)
    _run(ledger, threads, job, stuck, (), state)
    ledger.submitted(state)

    returns_within(5, lambda: ledger.wait_out(["r", "unknown"]))

    assert not ledger.is_loading("r") and job.abandoned
    assert ledger.take_finished() == {"r"}
    assert ledger.take_errors() == {7}
    stuck.set()
