"""Admission of saves: a block is saved once offered `save_threshold` times, in bounded memory."""

from __future__ import annotations

import pytest

from kvwire.media.admission import SaveAdmission
from kvwire.media.cpu_pool.index import CPUPoolIndex


def h(n: int) -> bytes:
    return n.to_bytes(4, "big") * 8


def test_a_threshold_of_one_admits_every_block_at_once() -> None:
    admission = SaveAdmission(1)
    assert admission.admit(h(1))
    assert admission.count(h(1)) == 0  # nothing is counted


def test_a_block_is_admitted_from_its_threshold_th_sighting() -> None:
    admission = SaveAdmission(3)
    assert [admission.admit(h(1)) for _ in range(4)] == [False, False, True, True]
    assert not admission.admit(h(2))


def test_each_kv_cache_group_counts_its_blocks_apart() -> None:
    admission = SaveAdmission(2)
    admission.admit(h(1), group=0)
    assert not admission.admit(h(1), group=1)
    assert admission.admit(h(1), group=0)


def test_the_memory_is_fixed_however_many_blocks_go_by() -> None:
    admission = SaveAdmission(2, width=1024)
    for n in range(50_000):
        admission.admit(h(n))
    assert admission.memory_bytes == 4 * 1024
    assert [len(row) for row in admission._rows] == [1024] * 4


def test_blocks_seen_once_are_rarely_admitted_within_a_window() -> None:
    admission = SaveAdmission(2, width=4096)
    # As many one-off blocks as the sketch counts between two halvings.
    admitted = sum(admission.admit(h(n)) for n in range(4096))
    # About one in twenty is overstated (all four of its counters shared).
    assert admitted < 4096 * 0.06


def test_counts_halve_every_width_sightings() -> None:
    admission = SaveAdmission(3, width=1024)
    admission.admit(h(1))
    admission.admit(h(1))
    for n in range(2, 1024):
        admission.admit(h(n))
    # The 1024th sighting halved every counter: 2 became 1.
    assert admission.count(h(1)) == 1
    assert not admission.admit(h(1))


@pytest.mark.parametrize("threshold", [0, -1])
def test_a_threshold_below_one_is_refused(threshold: int) -> None:
    with pytest.raises(ValueError, match="threshold is >= 1"):
        SaveAdmission(threshold)


def test_the_width_is_a_power_of_two() -> None:
    with pytest.raises(ValueError, match="power of two"):
        SaveAdmission(2, width=1000)


# Through the pool's index, as the offload connector calls it.


def index(threshold: int, slots: int = 8) -> CPUPoolIndex:
    return CPUPoolIndex(slots, 1, "cpu", admission=SaveAdmission(threshold, width=1024))


def test_a_refused_block_and_the_blocks_after_it_get_no_slot_and_are_counted() -> None:
    pool = index(2)
    pool.prepare_save(0, [h(1)])
    pool.complete_save(0, [h(1)], success=True)  # admitted? no: offered once
    assert pool.count_held_prefix(0, [h(1)]) == 0
    assert pool.take_counters() == {"saves_not_admitted": 1}
    # h(1) is offered a second time: admitted; h(2) and h(3) a first time: refused.
    placed = pool.prepare_save(0, [h(1), h(2), h(3)])
    assert [block for block, _ in placed] == [h(1)]
    assert pool.take_counters() == {"saves_not_admitted": 2}
    pool.complete_save(0, [h(1)], success=True)
    assert pool.count_held_prefix(0, [h(1), h(2)]) == 1


def test_a_block_the_pool_holds_is_not_counted_again() -> None:
    admission = SaveAdmission(2, width=1024)
    pool = CPUPoolIndex(8, 1, "cpu", admission=admission)
    for _ in range(2):
        placed = pool.prepare_save(0, [h(1)])
    pool.complete_save(0, [block for block, _ in placed], success=True)
    pool.take_counters()
    assert pool.prepare_save(0, [h(1)]) == []
    assert admission.count(h(1)) == 2
    assert pool.take_counters() == {}


def test_a_block_after_one_the_pool_holds_is_still_admitted_on_its_own_count() -> None:
    pool = index(2)
    pool.prepare_save(0, [h(1)])
    placed = pool.prepare_save(0, [h(1), h(2)])
    assert [block for block, _ in placed] == [h(1)]
    placed = pool.prepare_save(0, [h(1), h(2)])
    assert [block for block, _ in placed] == [h(2)]


def test_without_admission_every_block_gets_a_slot() -> None:
    pool = CPUPoolIndex(8, 1, "cpu")
    placed = pool.prepare_save(0, [h(1), h(2)])
    assert [block for block, _ in placed] == [h(1), h(2)]
    assert pool.take_counters() == {}
