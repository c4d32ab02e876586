"""Every wait on the CPU pool's copy threads has a deadline.

The copies are plain memory copies, but a thread can still fall behind (a
backlog of jobs, a starved process): the forward pass waits for no copy past
``transfer_timeout_s``. A load still running then is a load error; a store
still running then counts failed, and leaves slots that later loads refuse.
A job given up on copies nothing more, into the cache or out of it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import pytest
import torch

from kvwire.blocks.format import BlockLayout
from kvwire.blocks.paged_cache import PagedKVCaches
from kvwire.blocks.transfers import BlockTransfer
from kvwire.interface.counters import Counters
from kvwire.media.cpu_pool import handler as cpu_pool_worker_module
from kvwire.media.cpu_pool.handler import CPUPoolTransferHandler
from tests.support.media import DrivenHandler
from tests.support.stores import HASHES, layout_caches
from tests.support.waits import TEST_LIMIT_S, returns_within, wait_until

LAYOUT = BlockLayout(num_layers=2, block_size=4, num_kv_heads=2, head_size=8, dtype="float32")
DEADLINE_S = 0.2


@pytest.fixture
def copies_go_on() -> Iterator[threading.Event]:
    """While clear, copy jobs stall where the test put them (set at teardown)."""
    event = threading.Event()
    try:
        yield event
    finally:
        event.set()


def _worker(
    caches: dict[str, torch.Tensor], counters: Counters
) -> DrivenHandler[CPUPoolTransferHandler]:
    handler = CPUPoolTransferHandler(
        layouts=(LAYOUT,),
        caches=(PagedKVCaches(caches, LAYOUT, sorted(caches)),),
        num_slots=4,
        io_threads=1,
        counters=counters,
        transfer_timeout_s=DEADLINE_S,
    )
    return DrivenHandler(handler)


def _stored(worker: DrivenHandler[CPUPoolTransferHandler]) -> None:
    """Blocks 0 and 1 stored, whole, in slots 0 and 1 under ``HASHES``."""
    worker.save(
        [BlockTransfer(request_id="p", block_ids=(0, 1), slots=(0, 1), block_hashes=HASHES)]
    )
    assert worker.wait_for_saves(TEST_LIMIT_S)


def _stall_loads_until(monkeypatch: pytest.MonkeyPatch, event: threading.Event) -> None:
    """Each load stalls in verification (outside any copy) until ``event`` is set."""
    verify = cpu_pool_worker_module.verify_entry

    def stalled_verify(*args: object) -> None:
        event.wait(TEST_LIMIT_S)
        verify(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_pool_worker_module, "verify_entry", stalled_verify)


def _stall_stores_until(monkeypatch: pytest.MonkeyPatch, event: threading.Event) -> None:
    """Each store stalls before its first copy until ``event`` is set."""
    chunks = cpu_pool_worker_module.cache_sized_chunks

    def stalled_chunks(count: int, entry_bytes: int) -> list[range]:
        event.wait(TEST_LIMIT_S)
        return chunks(count, entry_bytes)

    monkeypatch.setattr(cpu_pool_worker_module, "cache_sized_chunks", stalled_chunks)


def test_a_load_past_its_deadline_is_a_load_error_and_copies_nothing_later(
    monkeypatch: pytest.MonkeyPatch, copies_go_on: threading.Event
) -> None:
    caches = layout_caches(LAYOUT, seed=2)
    counters = Counters()
    worker = _worker(caches, counters)
    _stored(worker)
    _stall_loads_until(monkeypatch, copies_go_on)
    worker.start_loads(
        [BlockTransfer(request_id="c", block_ids=(2, 3), slots=(0, 1), block_hashes=HASHES)], []
    )

    assert returns_within(5, worker.take_load_errors) == {2, 3}
    assert counters.take()["load_timeouts"] == 2
    before = {name: cache[:, 2:4].clone() for name, cache in caches.items()}

    copies_go_on.set()
    # One copy thread: a later load ends only after the stalled one has.
    worker.start_loads(
        [BlockTransfer(request_id="d", block_ids=(3,), slots=(0,), block_hashes=HASHES[:1])], []
    )
    assert worker.take_load_errors() == set()
    for name, cache in caches.items():
        assert torch.equal(cache[:, 2], before[name][:, 0])  # never written
    worker.close()


def test_an_asynchronous_load_past_its_deadline_finishes_with_every_block_failed(
    monkeypatch: pytest.MonkeyPatch, copies_go_on: threading.Event
) -> None:
    worker = _worker(layout_caches(LAYOUT, seed=2), Counters())
    _stored(worker)
    _stall_loads_until(monkeypatch, copies_go_on)
    worker.start_loads(
        [], [BlockTransfer(request_id="c", block_ids=(2, 3), slots=(0, 1), block_hashes=HASHES)]
    )

    finished = wait_until(worker.take_finished_loads, "the load to finish")

    assert finished == {"c"}
    assert not worker.is_busy("c")
    assert worker.take_load_errors() == {2, 3}
    worker.close()


def test_a_store_past_its_deadline_counts_failed_and_its_blocks_are_released(
    monkeypatch: pytest.MonkeyPatch, copies_go_on: threading.Event
) -> None:
    counters = Counters()
    worker = _worker(layout_caches(LAYOUT, seed=2), counters)
    _stall_stores_until(monkeypatch, copies_go_on)
    worker.save(
        [BlockTransfer(request_id="p", block_ids=(0, 1), slots=(0, 1), block_hashes=HASHES)]
    )
    assert worker.is_busy("p")

    # The request was preempted: the forward pass reuses its blocks next.
    released = returns_within(5, lambda: worker.release_saves_reading(["p"], frozenset()))

    assert released == []  # waited out, not released: no block of it was given away
    assert not worker.is_busy("p")
    taken = counters.take()
    assert taken["save_timeouts"] == 2
    assert "blocks_saved" not in taken
    copies_go_on.set()
    # One copy thread: a later store ends only after the stalled one has.
    worker.save(
        [BlockTransfer(request_id="q", block_ids=(2,), slots=(2,), block_hashes=(b"\x03" * 32,))]
    )
    assert worker.wait_for_saves(TEST_LIMIT_S)
    # The stalled store, going on late, wrote no slot: a load refuses them.
    worker.start_loads(
        [BlockTransfer(request_id="c", block_ids=(2, 3), slots=(0, 1), block_hashes=HASHES)], []
    )
    assert worker.take_load_errors() == {2, 3}
    worker.close()


def test_waiting_for_every_store_ends_at_their_deadline(
    monkeypatch: pytest.MonkeyPatch, copies_go_on: threading.Event
) -> None:
    worker = _worker(layout_caches(LAYOUT, seed=2), Counters())
    _stall_stores_until(monkeypatch, copies_go_on)
    worker.save(
        [BlockTransfer(request_id="p", block_ids=(0, 1), slots=(0, 1), block_hashes=HASHES)]
    )

    assert worker.wait_for_saves(0.01) is False  # still running
    assert returns_within(5, worker.wait_for_saves) is True  # given up on at its deadline
    worker.close()


def test_close_logs_a_failed_step_and_still_stops_the_threads(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = _worker(layout_caches(LAYOUT, seed=2), Counters())

    def broken_end_all(until: float | None = None) -> bool:
        raise RuntimeError("a bug in the wait")

    monkeypatch.setattr(worker.handler._jobs, "end_all", broken_end_all)
    with caplog.at_level(logging.ERROR):
        worker.close()

    assert "shutdown: ending transfers failed" in caplog.text
    with pytest.raises(RuntimeError, match="after shutdown"):
        worker.save(
            [BlockTransfer(request_id="p", block_ids=(0,), slots=(0,), block_hashes=HASHES[:1])]
        )
