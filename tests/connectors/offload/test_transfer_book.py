"""The offload connector's worker-side bookkeeping, the same for every medium, over real threads.

:class:`GatedHandler` runs each job on a real thread
(:class:`~kvwire.media.IOThreads`) that waits until the test
opens its request's gate, so a test decides when each job ends and which of
its blocks fail.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Iterable, Iterator, Sequence, Set

import pytest

from kvwire.blocks.transfers import BlockTransfer
from kvwire.connectors.offload.transfer_book import TransferBook
from kvwire.media import IOThreads
from kvwire.media.base import JobResult, TransferHandler, TransferJob, TransferKind
from tests.support.waits import TEST_LIMIT_S, returns_within, wait_until


class GatedHandler(TransferHandler):
    """Each job waits for its requests' gates (:meth:`open`), then fails the blocks in ``fail``."""

    def __init__(self) -> None:
        self._threads = IOThreads(4, "test-book")
        self._lock = threading.Lock()
        self._gates: dict[str, threading.Event] = {}
        self._futures: dict[int, concurrent.futures.Future[None]] = {}
        self._ended: list[JobResult] = []
        self.fail: set[int] = set()
        self.jobs: list[TransferJob] = []
        self.released: list[tuple[set[str], Set[int]]] = []

    def open(self, request_id: str) -> None:
        self._gate(request_id).set()

    def _gate(self, request_id: str) -> threading.Event:
        with self._lock:
            return self._gates.setdefault(request_id, threading.Event())

    def submit(self, job: TransferJob) -> None:
        self.jobs.append(job)
        gates = [self._gate(transfer.request_id) for transfer in job.transfers]
        self._futures[job.job_id] = self._threads.submit(self._run, job, gates)

    def _run(self, job: TransferJob, gates: list[threading.Event]) -> None:
        for gate in gates:
            gate.wait(TEST_LIMIT_S)
        blocks = {block_id for transfer in job.transfers for block_id in transfer.block_ids}
        failed = blocks & self.fail if job.kind is TransferKind.LOAD else set()
        with self._lock:
            self._ended.append(JobResult(job.job_id, frozenset(failed)))

    def poll(self) -> list[JobResult]:
        with self._lock:
            ended, self._ended = self._ended, []
        return ended

    def wait(self, job_ids: Iterable[int], until: float | None = None) -> bool:
        futures = [self._futures[job_id] for job_id in job_ids]
        timeout = TEST_LIMIT_S if until is None else max(0.0, until - time.monotonic())
        _, running = concurrent.futures.wait(futures, timeout=timeout)
        return not running

    def release_saves_reading(
        self, request_ids: Iterable[str], block_ids: Set[int]
    ) -> list[BlockTransfer]:
        self.released.append((set(request_ids), block_ids))
        return []

    def close(self) -> None:
        with self._lock:
            gates = list(self._gates.values())
        for gate in gates:
            gate.set()
        self._threads.shutdown()


@pytest.fixture
def handler() -> Iterator[GatedHandler]:
    built = GatedHandler()
    yield built
    built.close()


def _transfer(request_id: str, *block_ids: int, group: int = 0) -> BlockTransfer:
    hashes = tuple(bytes([block_id]) * 32 for block_id in block_ids)
    return BlockTransfer(
        request_id=request_id, block_ids=block_ids, block_hashes=hashes, group=group
    )


def test_a_steps_synchronous_loads_are_one_job_whose_failures_are_kept_until_taken(
    handler: GatedHandler,
) -> None:
    book = TransferBook(handler)
    handler.fail = {2, 5}
    book.start_loads([_transfer("a", 1, 2), _transfer("b", 5, 6)], [])
    assert [(job.kind, len(job.transfers)) for job in handler.jobs] == [(TransferKind.LOAD, 2)]
    threading.Timer(0.05, lambda: (handler.open("a"), handler.open("b"))).start()

    returns_within(5, book.wait_for_loads)

    assert book.load_errors_so_far() == {2, 5}
    assert book.load_errors_so_far() == {2, 5}  # not taken
    assert book.take_load_errors() == {2, 5}
    assert book.take_load_errors() == set()


def test_a_requests_asynchronous_load_finishes_once_its_job_ended_and_only_then_fails_blocks(
    handler: GatedHandler,
) -> None:
    book = TransferBook(handler)
    handler.fail = {3}
    book.start_loads([], [_transfer("r", 3, 4), _transfer("r", 7, group=1), _transfer("s", 9)])
    # One job per request, every KV cache group's transfers in it.
    assert sorted(len(job.transfers) for job in handler.jobs) == [1, 2]
    handler.open("s")
    wait_until(lambda: book.take_finished_loads() == {"s"}, "s to finish")
    assert book.is_busy("r")
    assert book.take_load_errors() == set()  # r's failed block: not before r is finished

    handler.open("r")
    assert handler.wait([job.job_id for job in handler.jobs])
    # Ended, and polled by the wait for this step's loads: still not reported finished.
    assert book.take_load_errors() == set()

    assert book.take_finished_loads() == {"r"}
    assert not book.is_busy("r")
    assert book.take_load_errors() == {3}
    assert book.take_finished_loads() == set()  # reported once


def test_waiting_for_asynchronous_loads_ends_with_them_or_at_the_timeout_not_with_saves(
    handler: GatedHandler,
) -> None:
    book = TransferBook(handler)
    returns_within(5, lambda: book.wait_for_async_loads(TEST_LIMIT_S))  # none in flight
    book.start_loads([], [_transfer("r", 1)])
    book.save([_transfer("q", 2)])

    returns_within(5, lambda: book.wait_for_async_loads(0.05))
    assert book.take_finished_loads() == set()
    threading.Timer(0.05, handler.open, ["r"]).start()
    returns_within(5, lambda: book.wait_for_async_loads(TEST_LIMIT_S))

    assert book.take_finished_loads() == {"r"}
    assert book.is_busy("q")  # its save was not waited for


def test_a_request_keeps_its_blocks_while_a_save_or_a_load_of_it_runs(
    handler: GatedHandler,
) -> None:
    book = TransferBook(handler)
    book.start_loads([], [_transfer("r", 1)])
    book.save([_transfer("r", 1), _transfer("r", 2, group=1), _transfer("q", 3)])
    assert [job.kind for job in handler.jobs].count(TransferKind.SAVE) == 2  # one per request
    book.take_finished_loads()
    assert book.is_busy("r") and book.is_busy("q")
    assert not book.is_busy("other")

    handler.open("q")
    wait_until(lambda: (book.take_finished_loads(), not book.is_busy("q"))[1], "q's save")
    assert book.is_busy("r")
    handler.open("r")
    wait_until(lambda: book.take_finished_loads() == {"r"}, "r's load")

    assert not book.is_busy("r")


def test_waiting_for_saves_reports_whether_they_ended_in_time(handler: GatedHandler) -> None:
    book = TransferBook(handler)
    book.save([_transfer("p", 1)])

    assert book.wait_for_saves(0.05) is False
    assert book.is_busy("p")
    handler.open("p")
    assert returns_within(5, book.wait_for_saves) is True
    assert not book.is_busy("p")
    assert book.wait_for_saves(0) is True  # none left


def test_a_preempted_requests_load_is_waited_out_before_its_saves_are_released(
    handler: GatedHandler,
) -> None:
    book = TransferBook(handler)
    book.start_loads([], [_transfer("r", 4), _transfer("s", 5)])
    opened = threading.Timer(0.1, lambda: handler.open("r"))
    opened.start()
    started = time.monotonic()

    book.release_saves_reading(["r"], frozenset({8}))

    assert time.monotonic() - started >= 0.09  # waited for r's load, not only released
    assert handler.released == [({"r"}, frozenset({8}))]
    assert not book.is_busy("r")
    assert book.is_busy("s")  # not preempted: not waited for
    assert book.take_finished_loads() == {"r"}


class RecordingScrub:
    """Records each scrub as ``(group, block ids)``."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, list[int]]] = []

    def __call__(self, group: int, block_ids: Sequence[int]) -> int:
        self.calls.append((group, list(block_ids)))
        return len(block_ids)


def test_a_synchronous_loads_failed_blocks_are_scrubbed_in_their_group_before_they_are_reported(
    handler: GatedHandler,
) -> None:
    scrub = RecordingScrub()
    book = TransferBook(handler, scrub)
    handler.fail = {2, 7}
    book.start_loads([_transfer("a", 1, 2), _transfer("a", 7, 8, group=1)], [])
    handler.open("a")

    book.wait_for_loads()

    assert sorted(scrub.calls) == [(0, [2]), (1, [7])]
    assert book.take_load_errors() == {2, 7}
    assert book.take_counters() == {"load_blocks_scrubbed": 2.0}
    assert book.take_counters() == {}


def test_an_asynchronous_loads_failed_blocks_are_scrubbed_when_it_ended_not_when_reported(
    handler: GatedHandler,
) -> None:
    scrub = RecordingScrub()
    book = TransferBook(handler, scrub)
    handler.fail = {3}
    book.start_loads([], [_transfer("r", 3, 4)])
    handler.open("r")
    assert handler.wait([job.job_id for job in handler.jobs])

    book.is_busy("r")  # nothing polled yet: nothing known, nothing scrubbed
    assert scrub.calls == []
    book.wait_for_saves()  # any poll records the ended load

    assert scrub.calls == [(0, [3])]
    assert book.take_finished_loads() == {"r"}
    assert book.take_load_errors() == {3}


def test_loads_that_succeed_and_saves_scrub_nothing(handler: GatedHandler) -> None:
    scrub = RecordingScrub()
    book = TransferBook(handler, scrub)
    handler.fail = {5}  # a save's blocks never fail
    book.start_loads([_transfer("a", 1, 2)], [_transfer("b", 3)])
    book.save([_transfer("c", 5)])
    for request_id in "abc":
        handler.open(request_id)

    book.wait_for_loads()
    book.wait_for_saves()
    wait_until(lambda: book.take_finished_loads() == {"b"}, "b's load")

    assert scrub.calls == []
    assert book.take_counters() == {}
