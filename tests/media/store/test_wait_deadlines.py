"""Every wait on a store worker's background jobs has a deadline.

A store that never answers (a hung server, a blocked file) must turn into
errors, never into a hung engine: a load still running at its deadline
(``transfer_timeout_s``) is a load error, which the engine computes again,
and a save still running then counts failed. A job given up on may still be
blocked in the store; when it finally returns it must write nothing into the
cache, whose blocks the engine has taken back by then.
"""

from __future__ import annotations

import concurrent.futures
import logging
import pathlib
import subprocess
import sys
import threading
import time
from collections.abc import Generator, Iterator, Mapping, Sequence
from typing import Any

import pytest
import torch

from kvwire.blocks.format import BlockLayout
from kvwire.blocks.memory import BlockMemory
from kvwire.blocks.transfers import BlockTransfer
from kvwire.config.extra_config import ExtraConfigError
from kvwire.connectors.offload import SharedStorageConnector
from kvwire.engine.engine import LLMEngine
from kvwire.exceptions import JobAbandoned
from kvwire.interface.counters import Counters
from kvwire.media import IOThreads
from kvwire.media.store._handler import StoreTransferHandler
from kvwire.media.store.base import BlockStore, CacheWrites, LateWriteError
from kvwire.media.store.directory import DirectoryMedium
from tests.support.connectors import read_options
from tests.support.engines import (
    shared_storage,
    tiny_config,
    tokens,
    with_connector,
    workload,
)
from tests.support.media import DrivenHandler
from tests.support.stores import HASHES, layout_caches, save_blocks_0_and_1
from tests.support.waits import TEST_LIMIT_S, returns_within, wait_until

ROOT = pathlib.Path(__file__).resolve().parents[3]
LAYOUT = BlockLayout(num_layers=2, block_size=4, num_kv_heads=2, head_size=8, dtype="float32")
NUM_SLOTS = 4
# Long enough for a healthy load on a busy machine, short enough for a fast test.
DEADLINE_S = 0.2

STORE_ANSWERS = threading.Event()
"""While clear, every :class:`StuckStore` read (and, if asked, write) waits for it."""


@pytest.fixture
def store_answers() -> Iterator[threading.Event]:
    """Stores hang until the test sets this (teardown sets it, so no thread outlives the test)."""
    STORE_ANSWERS.clear()
    try:
        yield STORE_ANSWERS
    finally:
        STORE_ANSWERS.set()


class MemoryStore(BlockStore):
    """Entries in a dict: a store that always answers at once."""

    medium = "memory"

    def __init__(self) -> None:
        self._entries: dict[str, bytes] = {}

    def count_prefix(self, keys: Sequence[str]) -> int:
        count = 0
        while count < len(keys) and keys[count] in self._entries:
            count += 1
        return count

    def put(self, keys: Sequence[str], entries: Sequence[memoryview]) -> list[bool]:
        for key, entry in zip(keys, entries, strict=True):
            self._entries[key] = bytes(entry)
        return [True] * len(keys)

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        sizes: list[int | None] = []
        for key, buffer in zip(keys, buffers, strict=True):
            entry = self._entries.get(key)
            if entry is not None:
                buffer[: len(entry)] = entry
            sizes.append(None if entry is None else len(entry))
        return sizes


class StuckStore(BlockStore):
    """``store``, whose reads (and writes, with ``stuck_writes``) wait for :data:`STORE_ANSWERS`."""

    def __init__(self, store: BlockStore, stuck_writes: bool = False) -> None:
        self._store = store
        self._stuck_writes = stuck_writes
        self.medium = store.medium

    def count_prefix(self, keys: Sequence[str]) -> int:
        return self._store.count_prefix(keys)

    def put(self, keys: Sequence[str], entries: Sequence[memoryview]) -> list[bool]:
        if self._stuck_writes:
            STORE_ANSWERS.wait(TEST_LIMIT_S)
        return self._store.put(keys, entries)

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        STORE_ANSWERS.wait(TEST_LIMIT_S)
        return self._store.get_into(keys, buffers)

    def read_each(
        self, keys: Sequence[str], buffers: Sequence[memoryview]
    ) -> Generator[tuple[int, int | None], None, None]:
        STORE_ANSWERS.wait(TEST_LIMIT_S)
        yield from self._store.read_each(keys, buffers)

    def discard(self, keys: Sequence[str]) -> None:
        self._store.discard(keys)

    def take_removed_keys(self) -> list[str]:
        return self._store.take_removed_keys()

    def close(self) -> None:
        self._store.close()


class InFlightStore(MemoryStore):
    """Reads straight into the ranges, one "syscall" per entry; the first stays in its
    syscall until :attr:`returns` is set, as a read blocked in the medium would."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.returns = threading.Event()
        self.writes: CacheWrites | None = None

    def read_into_ranges(
        self,
        keys: Sequence[str],
        ranges_per_key: Sequence[Sequence[memoryview]],
        writes: CacheWrites | None = None,
    ) -> Generator[tuple[int, int | None], None, None]:
        assert writes is not None
        self.writes = writes
        for index, (key, ranges) in enumerate(zip(keys, ranges_per_key, strict=True)):
            entry = memoryview(self._entries[key])
            with writes.writing():
                if index == 0:
                    self.entered.set()
                    self.returns.wait(TEST_LIMIT_S)
                offset = 0
                for part in ranges:
                    part[:] = entry[offset : offset + len(part)]
                    offset += len(part)
            yield index, len(entry)


class StuckReadsDirectory(DirectoryMedium):
    """The directory medium whose reads hang until the test lets them go."""

    def create_store(self, options: Mapping[str, Any]) -> BlockStore:
        return StuckStore(super().create_store(options))


class StuckReadsConnector(SharedStorageConnector):
    """Shared storage whose reads hang until the test lets them go."""

    default_medium = f"{__name__}:{StuckReadsDirectory.__name__}"


def _worker(
    store: BlockStore,
    caches: dict[str, torch.Tensor],
    counters: Counters,
    timeout_s: float,
    grace_s: float = TEST_LIMIT_S,
) -> DrivenHandler[StoreTransferHandler]:
    handler = StoreTransferHandler(
        store=store,
        layouts=(LAYOUT,),
        memories=(BlockMemory(caches, LAYOUT, sorted(caches)),),
        io_threads=1,
        batch_blocks=2,
        max_save_bytes=NUM_SLOTS * LAYOUT.entry_bytes,
        counters=counters,
        medium="test",
        transfer_timeout_s=timeout_s,
        late_write_grace_s=grace_s,
    )
    return DrivenHandler(handler)


def _saved_store() -> MemoryStore:
    """A store holding ``HASHES``, saved from random blocks."""
    store = MemoryStore()
    save_blocks_0_and_1(store, LAYOUT, seed=5)
    return store


def _worker_with_a_stuck_save(
    counters: Counters, timeout_s: float
) -> DrivenHandler[StoreTransferHandler]:
    """A worker whose save of blocks 0 and 1 (request "p") hangs in the store's write."""
    worker = _worker(
        StuckStore(MemoryStore(), stuck_writes=True),
        layout_caches(LAYOUT, seed=1),
        counters,
        timeout_s,
    )
    worker.save([BlockTransfer(request_id="p", block_ids=(0, 1), block_hashes=HASHES)])
    return worker


@pytest.mark.parametrize("value", [0, -1, "30", True, float("inf"), float("nan"), 10**6])
def test_a_transfer_timeout_that_is_no_finite_positive_number_is_refused_by_name(
    tmp_path: pathlib.Path, value: object
) -> None:
    config = shared_storage(tiny_config(), tmp_path, transfer_timeout_s=value)
    assert config.kv_transfer_config is not None

    with pytest.raises(
        ExtraConfigError, match=r"transfer_timeout_s: .* expected a finite number of s"
    ):
        read_options(SharedStorageConnector, config.kv_transfer_config)


# ------------------------------------------------------------------- loads


def test_a_load_stuck_in_the_store_is_a_load_error_at_its_deadline(
    store_answers: threading.Event,
) -> None:
    counters = Counters()
    worker = _worker(StuckStore(_saved_store()), layout_caches(LAYOUT, None), counters, DEADLINE_S)
    worker.start_loads([BlockTransfer(request_id="c", block_ids=(2, 3), block_hashes=HASHES)], [])

    assert returns_within(5, worker.take_load_errors) == {2, 3}
    taken = counters.take()
    assert taken["load_timeouts"] == 2
    assert taken["load_errors"] == 2
    worker.close(timeout_s=0)


def test_a_stuck_load_that_returns_late_writes_nothing_into_the_cache(
    store_answers: threading.Event,
) -> None:
    caches = layout_caches(LAYOUT, None)
    worker = _worker(StuckStore(_saved_store()), caches, Counters(), DEADLINE_S)
    worker.start_loads([BlockTransfer(request_id="c", block_ids=(2, 3), block_hashes=HASHES)], [])
    assert worker.take_load_errors() == {2, 3}
    # The engine computes the blocks again into the same cache blocks.
    for cache in caches.values():
        cache[:, 2:4] = 7.0

    store_answers.set()  # the store answers at last, with good entries
    wait_until(lambda: worker.handler.idle(), "the stuck job to end")

    for cache in caches.values():
        assert bool((cache[:, 2:4] == 7.0).all())
    worker.close()


def test_a_given_up_load_waits_for_its_read_under_way_and_then_writes_nothing_more() -> None:
    store = InFlightStore()
    save_blocks_0_and_1(store, LAYOUT, seed=5)
    caches = layout_caches(LAYOUT, None)
    worker = _worker(store, caches, Counters(), DEADLINE_S)
    worker.start_loads([BlockTransfer(request_id="c", block_ids=(2, 3), block_hashes=HASHES)], [])
    assert store.entered.wait(TEST_LIMIT_S)
    errors: list[set[int]] = []
    waiter = threading.Thread(target=lambda: errors.append(worker.take_load_errors()))
    waiter.start()

    # Given up on at its deadline, while its first read is still in its syscall.
    wait_until(lambda: store.writes is not None and store.writes.closed, "the load given up on")
    store.returns.set()
    waiter.join(TEST_LIMIT_S)

    assert errors == [{2, 3}]
    # The engine computes both blocks again; the load writes nothing more into them.
    for cache in caches.values():
        cache[:, 2:4] = 7.0
    wait_until(worker.handler.idle, "the load job to end")
    for cache in caches.values():
        assert bool((cache[:, 2:4] == 7.0).all())
    worker.close()


def test_a_read_that_outlives_the_grace_period_stops_the_engine_with_a_clear_error() -> None:
    store = InFlightStore()
    save_blocks_0_and_1(store, LAYOUT, seed=5)
    worker = _worker(store, layout_caches(LAYOUT, None), Counters(), DEADLINE_S, grace_s=0.05)
    worker.start_loads([BlockTransfer(request_id="c", block_ids=(2, 3), block_hashes=HASHES)], [])
    assert store.entered.wait(TEST_LIMIT_S)
    try:
        with pytest.raises(LateWriteError, match="still writing into the KV cache"):
            worker.take_load_errors()
    finally:
        store.returns.set()
    worker.close()


def test_runs_after_one_whose_read_outlived_the_grace_are_given_up_on_before_the_error() -> None:
    store = InFlightStore()
    save_blocks_0_and_1(store, LAYOUT, seed=5)
    caches = layout_caches(LAYOUT, None)
    worker = _worker(store, caches, Counters(), DEADLINE_S, grace_s=0.05)
    # The one load thread: the first run sits in its read, the second waits for the thread.
    worker.start_loads(
        [
            BlockTransfer(request_id="a", block_ids=(2, 3), block_hashes=HASHES),
            BlockTransfer(request_id="b", block_ids=(0, 1), block_hashes=HASHES),
        ],
        [],
    )
    assert store.entered.wait(TEST_LIMIT_S)
    try:
        with pytest.raises(LateWriteError):
            worker.take_load_errors()
    finally:
        store.returns.set()
    # Both runs' blocks are load errors, and the second never writes into the cache.
    assert worker.take_load_errors() == {0, 1, 2, 3}
    wait_until(worker.handler.idle, "the stuck run to end")
    assert not any(bool(cache[:, 0:2].any()) for cache in caches.values())
    worker.close()


def test_an_async_load_whose_give_up_raised_is_later_finished_with_its_blocks_failed() -> None:
    store = InFlightStore()
    save_blocks_0_and_1(store, LAYOUT, seed=5)
    worker = _worker(store, layout_caches(LAYOUT, None), Counters(), DEADLINE_S, grace_s=0.05)
    worker.start_loads([], [BlockTransfer(request_id="c", block_ids=(2, 3), block_hashes=HASHES)])
    assert store.entered.wait(TEST_LIMIT_S)

    def given_up() -> bool:
        try:
            worker.take_finished_loads()
        except LateWriteError:
            return True
        return False

    try:
        wait_until(given_up, "the load past its deadline to be given up on")
        assert worker.is_busy("c")  # its blocks stay kept until reported
        # A later call (close, or a caller that logged the error) reports it: nothing loaded.
        assert worker.take_finished_loads() == {"c"}
        assert worker.take_load_errors() == {2, 3}
    finally:
        store.returns.set()
    worker.close()


class FanOutStore(MemoryStore):
    """Reads raise after handing the ranges to a thread of the store's (a cluster's fan-out),
    which writes into them once :attr:`late` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.late = threading.Event()
        self.outcome: list[str] = []
        self.fan_out: threading.Thread | None = None

    def read_into_ranges(
        self,
        keys: Sequence[str],
        ranges_per_key: Sequence[Sequence[memoryview]],
        writes: CacheWrites | None = None,
    ) -> Generator[tuple[int, int | None], None, None]:
        assert writes is not None

        def write_late() -> None:
            self.late.wait(TEST_LIMIT_S)
            try:
                with writes.writing():
                    target = ranges_per_key[0][1]
                    target[:] = b"\xff" * len(target)
                self.outcome.append("written")
            except JobAbandoned:
                self.outcome.append("refused")

        self.fan_out = threading.Thread(target=write_late)
        self.fan_out.start()
        raise RuntimeError("the store failed while a thread of its own still reads")
        yield  # a generator, as the method must be


def test_a_load_the_store_failed_lets_no_thread_of_the_store_write_once_reported() -> None:
    store = FanOutStore()
    save_blocks_0_and_1(store, LAYOUT, seed=5)
    caches = layout_caches(LAYOUT, None)
    worker = _worker(store, caches, Counters(), TEST_LIMIT_S)
    worker.start_loads([], [BlockTransfer(request_id="c", block_ids=(2, 3), block_hashes=HASHES)])

    assert wait_until(worker.take_finished_loads, "the failed load to finish") == {"c"}
    assert worker.take_load_errors() == {2, 3}
    store.late.set()
    assert store.fan_out is not None
    store.fan_out.join(TEST_LIMIT_S)
    assert store.outcome == ["refused"]
    assert not any(bool(cache[:, 2:4].any()) for cache in caches.values())
    worker.close()


def test_an_asynchronous_load_stuck_past_its_deadline_is_finished_with_every_block_failed(
    store_answers: threading.Event,
) -> None:
    caches = layout_caches(LAYOUT, None)
    worker = _worker(StuckStore(_saved_store()), caches, Counters(), DEADLINE_S)
    worker.start_loads([], [BlockTransfer(request_id="c", block_ids=(2, 3), block_hashes=HASHES)])
    assert worker.is_busy("c")

    finished = wait_until(worker.take_finished_loads, "the load to finish")

    assert finished == {"c"}
    assert not worker.is_busy("c")  # its blocks may be freed
    assert worker.take_load_errors() == {2, 3}
    store_answers.set()
    wait_until(lambda: worker.handler.idle(), "the stuck job to end")
    assert not any(bool(cache[:, 2:4].any()) for cache in caches.values())
    assert worker.take_finished_loads() == set()  # reported once
    worker.close()


def test_a_load_queued_behind_stuck_loads_fails_at_its_deadline_instead_of_waiting(
    store_answers: threading.Event,
) -> None:
    counters = Counters()
    worker = _worker(StuckStore(_saved_store()), layout_caches(LAYOUT, None), counters, DEADLINE_S)
    # Two stuck loads hold the one load thread past their deadline.
    worker.start_loads(
        [
            BlockTransfer(request_id="a", block_ids=(0, 1), block_hashes=HASHES),
            BlockTransfer(request_id="b", block_ids=(2, 3), block_hashes=HASHES),
        ],
        [],
    )
    assert worker.take_load_errors() == {0, 1, 2, 3}

    returns_within(
        5,
        lambda: worker.start_loads(
            [BlockTransfer(request_id="c", block_ids=(2, 3), block_hashes=HASHES)], []
        ),
    )

    assert worker.take_load_errors() == {2, 3}
    assert counters.take()["load_timeouts"] == 6
    worker.close(timeout_s=0)


@pytest.mark.slow
@pytest.mark.parametrize("async_load", [False, True])
def test_loads_through_the_engine_past_their_deadline_are_computed_again(
    tmp_path: pathlib.Path, store_answers: threading.Event, async_load: bool
) -> None:
    config = tiny_config()
    requests = workload(seed=4)
    with LLMEngine(config) as engine:
        reference = tokens(engine.generate(requests))
    with LLMEngine(shared_storage(config, tmp_path)) as producer:
        producer.generate(requests)
    stuck = with_connector(
        config,
        "StuckReadsConnector",
        {
            "shared_storage_path": str(tmp_path),
            "transfer_timeout_s": DEADLINE_S,
            "async_load": async_load,
        },
        kv_role="kv_consumer",
        module_path=__name__,
    )

    started = time.monotonic()
    with LLMEngine(stuck) as consumer:
        outputs = consumer.generate(requests)
        stats = consumer.connector_stats.data

    assert tokens(outputs) == reference
    assert stats["load_timeouts"] > 0
    assert sum(output.num_load_failures for output in outputs) > 0
    assert time.monotonic() - started < 10


# ------------------------------------------------------------------- saves


def test_a_save_stuck_past_its_deadline_counts_failed_and_is_no_longer_waited_for(
    store_answers: threading.Event,
) -> None:
    counters = Counters()
    worker = _worker_with_a_stuck_save(counters, DEADLINE_S)

    assert returns_within(5, worker.wait_for_saves) is True

    taken = counters.take()
    assert taken["save_timeouts"] == 2
    assert taken["save_errors"] == 2
    store_answers.set()
    wait_until(lambda: worker.handler.idle(), "the stuck save to end")
    assert "blocks_saved" not in counters.take()  # counted once, as failed
    worker.close()


def test_a_save_waited_for_briefly_reports_it_is_still_running(
    store_answers: threading.Event,
) -> None:
    worker = _worker_with_a_stuck_save(Counters(), TEST_LIMIT_S)

    assert worker.wait_for_saves(0.05) is False
    store_answers.set()
    assert worker.wait_for_saves(TEST_LIMIT_S) is True
    worker.close()


class _FuturesTimeoutOfPython310(concurrent.futures._base.Error):
    """``concurrent.futures.TimeoutError`` as Python 3.10 has it: no builtin ``TimeoutError``."""


def test_the_futures_timeout_of_python_3_10_does_not_escape_a_wait_for_saves(
    store_answers: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before 3.11, Future.result(timeout=...) raised a class of its own, which
    # ``except TimeoutError`` did not catch: the wait raised, and close() then
    # skipped shutting its thread pools down.
    monkeypatch.setattr(concurrent.futures._base, "TimeoutError", _FuturesTimeoutOfPython310)
    monkeypatch.setattr(concurrent.futures, "TimeoutError", _FuturesTimeoutOfPython310)
    worker = _worker_with_a_stuck_save(Counters(), TEST_LIMIT_S)

    assert worker.wait_for_saves(0.05) is False
    worker.close(timeout_s=0.05)

    with pytest.raises(RuntimeError, match="after shutdown"):
        worker.start_loads(
            [BlockTransfer(request_id="c", block_ids=(2, 3), block_hashes=HASHES)], []
        )


# ------------------------------------------------------------------- close


def test_close_stops_the_threads_when_a_save_outlives_its_wait(
    store_answers: threading.Event,
) -> None:
    worker = _worker_with_a_stuck_save(Counters(), TEST_LIMIT_S)

    returns_within(5, lambda: worker.close(timeout_s=0.05))

    with pytest.raises(RuntimeError, match="after shutdown"):
        worker.save([BlockTransfer(request_id="p", block_ids=(2, 3), block_hashes=HASHES)])


def test_close_logs_a_failed_step_and_still_stops_the_threads(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = _worker(MemoryStore(), layout_caches(LAYOUT, None), Counters(), 30)

    def broken_end_all(until: float | None = None) -> bool:
        raise OSError("the store vanished")

    monkeypatch.setattr(worker.handler._jobs, "end_all", broken_end_all)
    with caplog.at_level(logging.ERROR):
        worker.close()

    assert "shutdown: ending transfers failed" in caplog.text
    with pytest.raises(RuntimeError, match="after shutdown"):
        worker.save([BlockTransfer(request_id="p", block_ids=(0, 1), block_hashes=HASHES)])


# ------------------------------------------------------------- process exit

_EXIT_WITH_A_JOB_STUCK = """
import threading
from tests.media.store import test_wait_deadlines as t
from tests.support.stores import HASHES, layout_caches
from kvwire.interface.counters import Counters
from kvwire.blocks.transfers import BlockTransfer

t.STORE_ANSWERS.clear()  # and nobody ever sets it: the read stays stuck
worker = t._worker(t.StuckStore(t._saved_store()), layout_caches(t.LAYOUT, None), Counters(), 0.1)
worker.start_loads([BlockTransfer(request_id="c", block_ids=(2, 3), block_hashes=HASHES)], [])
assert worker.take_load_errors() == {2, 3}
worker.close(timeout_s=0)
print("closed", flush=True)
"""


@pytest.mark.slow
def test_a_process_exits_while_a_job_it_gave_up_on_is_still_stuck() -> None:
    # The stuck read waits TEST_LIMIT_S; an exit that joined its thread would wait as long.
    started = time.monotonic()
    finished = subprocess.run(
        [sys.executable, "-c", _EXIT_WITH_A_JOB_STUCK],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TEST_LIMIT_S * 2,
        check=False,
    )

    assert finished.returncode == 0, finished.stderr
    assert finished.stdout == "closed\n"
    assert time.monotonic() - started < TEST_LIMIT_S / 2


def test_job_threads_cancel_the_jobs_not_started_at_shutdown_and_take_no_more(
    store_answers: threading.Event,
) -> None:
    threads = IOThreads(1, "test")
    started = threading.Event()

    def stuck() -> bool:
        started.set()
        return store_answers.wait(TEST_LIMIT_S)

    running = threads.submit(stuck)
    queued = threads.submit(lambda: None)
    assert started.wait(TEST_LIMIT_S)

    threads.shutdown()

    assert queued.cancelled()
    with pytest.raises(RuntimeError, match="after shutdown"):
        threads.submit(lambda: None)
    store_answers.set()
    assert running.result(TEST_LIMIT_S) is True
