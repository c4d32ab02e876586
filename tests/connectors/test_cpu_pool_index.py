"""The CPU pool's LRU index: what the scheduler side decides."""

from __future__ import annotations

from kvwire.connectors.cpu_pool_index import CPUPoolIndex


def h(n: int) -> bytes:
    return bytes([n]) * 32


def stored(index: CPUPoolIndex, *numbers: int) -> None:
    hashes = [h(n) for n in numbers]
    index.prepare_store(hashes)
    index.complete_store(hashes)


def test_a_block_is_invisible_until_its_store_completes():
    index = CPUPoolIndex(4)
    index.prepare_store([h(1)])
    assert index.count_ready_prefix([h(1)]) == 0
    index.complete_store([h(1)])
    assert index.count_ready_prefix([h(1)]) == 1


def test_the_ready_prefix_stops_at_the_first_missing_block():
    index = CPUPoolIndex(4)
    stored(index, 1, 3)
    assert index.count_ready_prefix([h(1), h(2), h(3)]) == 1


def test_the_least_recently_used_block_is_evicted_first():
    index = CPUPoolIndex(2)
    stored(index, 1, 2)
    index.start_load([h(1)])
    index.finish_load([h(1)])  # 1 is now more recent than 2
    stored(index, 3)
    assert index.take_evicted() == [h(2)]
    assert index.is_ready(h(1)) and index.is_ready(h(3))


def test_a_block_being_loaded_is_never_evicted():
    index = CPUPoolIndex(1)
    stored(index, 1)
    index.start_load([h(1)])
    assert index.prepare_store([h(2)]) == []
    assert index.is_ready(h(1))


def test_a_block_being_stored_is_never_evicted():
    index = CPUPoolIndex(1)
    index.prepare_store([h(1)])
    assert index.prepare_store([h(2)]) == []
    assert h(1) in index


def test_storing_a_present_block_again_takes_no_slot():
    index = CPUPoolIndex(2)
    stored(index, 1)
    assert index.prepare_store([h(1), h(2)]) == [(h(2), 1)]


def test_an_abandoned_store_frees_its_slot():
    index = CPUPoolIndex(1)
    index.prepare_store([h(1)])
    index.abandon_store([h(1)])
    assert index.prepare_store([h(2)]) == [(h(2), 0)]


def test_clear_keeps_blocks_in_use():
    index = CPUPoolIndex(3)
    stored(index, 1, 2)
    index.start_load([h(2)])
    assert index.clear() is False
    assert not index.is_ready(h(1)) and index.is_ready(h(2))
