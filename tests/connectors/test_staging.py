"""Staging slots: taken lowest first, so that slots taken together are consecutive."""

from __future__ import annotations

import threading

import pytest

from kvwire.connectors.block_format import BlockLayout
from kvwire.connectors.staging import StagingBuffers

LAYOUT = BlockLayout(num_layers=1, block_size=2, num_kv_heads=1, head_size=4, dtype="float32")


def test_slots_given_back_in_any_order_are_taken_again_lowest_first() -> None:
    staging = StagingBuffers(LAYOUT, 8)
    first, second = staging.acquire(4, 30), staging.acquire(4, 30)
    assert (first, second) == ([0, 1, 2, 3], [4, 5, 6, 7])

    # Jobs finish in any order; the slots they give back are handed out in order.
    staging.release([6, 4])
    staging.release([1])
    staging.release([7, 5, 0])

    assert staging.try_acquire(3) == [0, 1, 4]
    assert staging.try_acquire(8) == [5, 6, 7]
    assert staging.try_acquire(1) == []
    assert staging.num_free == 0


def test_acquire_waits_for_a_slot_and_takes_what_is_free() -> None:
    staging = StagingBuffers(LAYOUT, 2)
    held = staging.acquire(2, 30)
    taken: list[int] = []
    waiter = threading.Thread(target=lambda: taken.extend(staging.acquire(2, 30)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # nothing free: it waits

    staging.release(held[1:])
    waiter.join(30)

    assert taken == [1]


def test_acquire_gives_up_when_no_slot_comes_free_in_time() -> None:
    staging = StagingBuffers(LAYOUT, 1)
    held = staging.acquire(1, 30)

    # The slot's holder never gives it back (a job stuck in its store): the
    # caller gets no slot rather than waiting forever.
    assert staging.acquire(1, 0.05) == []
    assert staging.acquire(1, 0) == []
    staging.release(held)
    assert staging.acquire(1, 0) == [0]


def test_staging_needs_a_slot() -> None:
    with pytest.raises(ValueError, match="at least one slot, got 0"):
        StagingBuffers(LAYOUT, 0)
