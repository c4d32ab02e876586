"""The CPU pool's slot table: which slot holds which block, in LRU order."""

from __future__ import annotations

from kvwire.media.cpu_pool._slot_table import SlotTable


def _ready(index: SlotTable, group: int, block_hash: bytes) -> bool:
    return index.count_ready_prefix(group, [block_hash]) == 1


def h(n: int) -> bytes:
    return bytes([n]) * 32


def stored(index: SlotTable, *numbers: int) -> None:
    hashes = [h(n) for n in numbers]
    index.prepare_save(0, hashes)
    index.complete_save(0, hashes)


def test_a_block_is_invisible_until_its_store_completes():
    index = SlotTable(4)
    index.prepare_save(0, [h(1)])
    assert index.count_ready_prefix(0, [h(1)]) == 0
    index.complete_save(0, [h(1)])
    assert index.count_ready_prefix(0, [h(1)]) == 1


def test_the_ready_prefix_stops_at_the_first_missing_block():
    index = SlotTable(4)
    stored(index, 1, 3)
    assert index.count_ready_prefix(0, [h(1), h(2), h(3)]) == 1


def test_the_least_recently_used_block_is_evicted_first():
    index = SlotTable(2)
    stored(index, 1, 2)
    index.start_load(0, [h(1)])
    index.finish_load(0, [h(1)])  # 1 is now more recent than 2
    stored(index, 3)
    assert index.take_evicted() == ([h(2)],)
    assert _ready(index, 0, h(1)) and _ready(index, 0, h(3))


def test_a_prefix_is_evicted_from_its_tail_so_what_stays_is_still_a_prefix():
    index = SlotTable(3)
    stored(index, 1, 2, 3)  # one request's blocks: 1 first
    stored(index, 4)
    assert index.take_evicted() == ([h(3)],)
    index.start_load(0, [h(1), h(2)])
    index.finish_load(0, [h(1), h(2)])  # loaded together: 2 goes before 1
    stored(index, 5, 6)
    assert index.take_evicted() == ([h(4), h(2)],)
    assert index.count_ready_prefix(0, [h(1)]) == 1


def test_a_block_being_loaded_is_never_evicted():
    index = SlotTable(1)
    stored(index, 1)
    index.start_load(0, [h(1)])
    assert index.prepare_save(0, [h(2)]) == []
    assert _ready(index, 0, h(1))


def test_a_block_being_stored_is_never_evicted():
    index = SlotTable(1)
    index.prepare_save(0, [h(1)])
    assert index.prepare_save(0, [h(2)]) == []
    assert index.holds(0, h(1))


def test_storing_a_present_block_again_takes_no_slot():
    index = SlotTable(2)
    stored(index, 1)
    assert index.prepare_save(0, [h(1), h(2)]) == [(h(2), 1)]


def test_an_abandoned_store_frees_its_slot():
    index = SlotTable(1)
    index.prepare_save(0, [h(1)])
    index.abandon_save(0, [h(1)])
    assert index.prepare_save(0, [h(2)]) == [(h(2), 0)]


def test_clear_keeps_blocks_in_use():
    index = SlotTable(3)
    stored(index, 1, 2)
    index.start_load(0, [h(2)])
    assert index.clear() is False
    assert not _ready(index, 0, h(1)) and _ready(index, 0, h(2))


def test_a_hash_in_one_group_is_not_held_in_another():
    index = SlotTable(4, num_groups=2)
    index.prepare_save(0, [h(1)])
    index.complete_save(0, [h(1)])
    assert index.count_ready_prefix(0, [h(1)]) == 1
    assert index.count_ready_prefix(1, [h(1)]) == 0
    assert not index.holds(1, h(1))


def test_each_group_stores_a_hash_in_a_slot_of_its_own():
    index = SlotTable(4, num_groups=2)
    assert index.prepare_save(0, [h(1)]) == [(h(1), 0)]
    assert index.prepare_save(1, [h(1)]) == [(h(1), 1)]
    assert len(index) == 2


def test_eviction_is_least_recently_used_across_groups_and_reported_per_group():
    index = SlotTable(2, num_groups=2)
    for group in (1, 0):
        index.prepare_save(group, [h(1)])
        index.complete_save(group, [h(1)])
    index.start_load(1, [h(1)])
    index.finish_load(1, [h(1)])  # group 1's entry is now the more recent
    index.prepare_save(1, [h(2)])
    assert index.take_evicted() == ([h(1)], [])
    assert not _ready(index, 0, h(1)) and _ready(index, 1, h(1))


def test_discarding_a_block_in_one_group_keeps_the_other_groups_entry():
    index = SlotTable(2, num_groups=2)
    for group in (0, 1):
        index.prepare_save(group, [h(1)])
        index.complete_save(group, [h(1)])
    index.discard(1, [h(1)])
    assert _ready(index, 0, h(1)) and not _ready(index, 1, h(1))
    assert index.take_evicted() == ([], [h(1)])


def test_the_busy_count_is_every_slot_no_eviction_may_take_whatever_happens():
    import random

    rng = random.Random(7)
    index = SlotTable(6)
    loads: list[list[bytes]] = []
    promotions: list[list[bytes]] = []
    for _ in range(3000):
        op = rng.randrange(7)
        blocks = [h(rng.randrange(12)) for _ in range(rng.randint(1, 3))]
        if op == 0:
            placed = [block for block, _ in index.prepare_save(0, blocks)]
            if rng.random() < 0.8:
                index.complete_save(0, placed)
            else:
                index.abandon_save(0, placed)
        elif op == 1 and index.count_ready_prefix(0, blocks) == len(blocks):
            index.start_load(0, blocks)
            loads.append(blocks)
        elif op == 2 and loads:
            index.finish_load(0, loads.pop(rng.randrange(len(loads))))
        elif op == 3:
            slots = index.start_promotion(0, blocks)
            promotions.append(
                [b for b, slot in zip(blocks, slots, strict=True) if slot is not None]
            )
        elif op == 4 and promotions:
            brought = promotions.pop(rng.randrange(len(promotions)))
            index.finish_promotion(0, brought, brought[:1] if rng.random() < 0.3 else [])
        elif op == 5:
            index.clear()
        elif op == 6:
            index.discard(0, blocks)
        busy = sum(
            1
            for block, slot in index._held[0].items()
            if block not in index._ready[0] or index._load_refs[slot] > 0
        )
        assert index.busy == busy


def test_forgetting_the_evicted_blocks_counts_them_and_leaves_none_to_take():
    index = SlotTable(1)
    stored(index, 1)
    stored(index, 2)
    stored(index, 3)
    assert index.forget_evicted() == 2
    assert index.take_evicted() == ([],)


def test_the_holder_of_a_group_tests_what_holds_tests():
    index = SlotTable(2, num_groups=2)
    index.prepare_save(1, [h(1)])
    holds_1, holds_0 = index.holder(1), index.holder(0)
    assert (holds_1(h(1)), holds_0(h(1)), holds_1(h(2))) == (True, False, False)
