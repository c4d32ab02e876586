"""Eviction policies: each one's order, scan resistance, the continuation hint, pins kept."""

from __future__ import annotations

from collections.abc import Hashable

import pytest

from kvwire.media.cpu_pool._slot_table import SlotTable
from kvwire.media.cpu_pool.index import CPUPoolIndex
from kvwire.media.eviction import (
    ARCPolicy,
    EvictionPolicy,
    KVFIFOPolicy,
    LRUPolicy,
    S3FIFOPolicy,
)

POLICIES = [LRUPolicy, S3FIFOPolicy, ARCPolicy, KVFIFOPolicy]


def h(n: int) -> bytes:
    return n.to_bytes(4, "big") * 8


def anything(slot: int) -> bool:
    return True


def filled(policy: EvictionPolicy, count: int) -> EvictionPolicy:
    for slot in range(count):
        policy.insert(slot, ("block", slot))
    return policy


def test_lru_evicts_the_least_recently_used_entry() -> None:
    policy = filled(LRUPolicy(3), 3)
    policy.hit(0)
    assert [policy.victim(anything) for _ in range(3)] == [1, 2, 0]
    assert policy.victim(anything) is None


def test_lru_forgets_a_removed_entry() -> None:
    policy = filled(LRUPolicy(3), 3)
    policy.remove(0)
    assert len(policy) == 2
    assert policy.victim(anything) == 1


def test_s3fifo_evicts_an_entry_used_once_before_one_used_again() -> None:
    policy = filled(S3FIFOPolicy(10), 10)
    policy.hit(0)
    # Entry 0 was used again: it moves to the main queue; 1, never used again, leaves.
    assert policy.victim(anything) == 1
    assert _drained(policy) == [*range(2, 10), 0]


def test_s3fifo_admits_a_block_its_ghost_queue_remembers_to_the_main_queue() -> None:
    policy = S3FIFOPolicy(10)
    policy.insert(0, "a")
    assert policy.victim(anything) == 0  # "a" leaves the small queue; its ghost stays
    policy.insert(0, "a")
    for slot in range(1, 10):
        policy.insert(slot, ("new", slot))
    # "a" came back to the main queue: the one-off entries of the small queue go first.
    assert _drained(policy)[-1] == 0


def test_s3fifo_gives_an_entry_of_the_main_queue_one_more_round_per_use() -> None:
    policy = S3FIFOPolicy(10)
    for slot, block in enumerate("ab"):
        policy.insert(slot, block)
        policy.victim(anything)
    policy.insert(0, "a")
    policy.insert(1, "b")  # both in the main queue now, "a" the oldest
    policy.hit(0)
    assert policy.victim(anything) == 1
    assert policy.victim(anything) == 0


def test_s3fifo_ghost_queue_is_bounded_by_the_main_queue_slots() -> None:
    policy = S3FIFOPolicy(10)
    for n in range(1000):
        policy.insert(0, n)
        assert policy.victim(anything) == 0
    assert len(policy._ghost) == 9


@pytest.mark.parametrize("policy_class", POLICIES)
def test_no_entry_is_evictable_means_no_victim(policy_class: type[EvictionPolicy]) -> None:
    policy = filled(policy_class(4), 4)
    assert policy.victim(lambda slot: False) is None
    assert len(policy) == 4


@pytest.mark.parametrize("policy_class", POLICIES)
def test_an_entry_in_use_is_passed_over(policy_class: type[EvictionPolicy]) -> None:
    policy = filled(policy_class(4), 4)
    assert policy.victim(lambda slot: slot != 0) == 1
    assert policy.victim(lambda slot: slot != 0) == 2


@pytest.mark.parametrize("policy_class", POLICIES)
def test_saves_in_flight_filling_the_new_entries_queue_leave_the_older_entries_evictable(
    policy_class: type[EvictionPolicy],
) -> None:
    # Blocks 0-9 used twice sit in the queue of entries used again; the saves of
    # blocks 100-109, not complete, fill the queue of new entries past its share:
    # every entry there is in use, so the victim comes from the other queue.
    table = SlotTable(20, policy=policy_class(20))
    for _ in range(2):
        for n in range(10):
            access(table, [n])
    in_flight = [h(n) for n in range(100, 110)]
    assert len(table.prepare_save(0, in_flight)) == 10
    placed = table.prepare_save(0, [h(200)])
    assert [block for block, _ in placed] == [h(200)]
    assert table.count_ready_prefix(0, [h(200)]) == 0  # being saved
    (evicted,) = [blocks for blocks in table.take_evicted() if blocks]
    assert evicted[0] in {h(n) for n in range(10)}


def _drained(policy: EvictionPolicy) -> list[int]:
    order = []
    while (slot := policy.victim(anything)) is not None:
        order.append(slot)
    return order


# Through the pool's slot table.


def access(table: SlotTable, numbers: list[int]) -> int:
    """One request as the connector drives the pool: load the held prefix, save the rest; hits."""
    hashes = [h(n) for n in numbers]
    held = table.count_ready_prefix(0, hashes)
    if held:
        table.start_load(0, hashes[:held])
        table.finish_load(0, hashes[:held])
    placed = [block for block, _ in table.prepare_save(0, hashes[held:])]
    table.complete_save(0, placed)
    return held


def hot_blocks_kept(policy: EvictionPolicy) -> int:
    """A hot set used twice, a scan of one-off blocks twice the pool, then the hot set again."""
    table = SlotTable(20, policy=policy)
    hot = list(range(8))
    for _ in range(2):
        for n in hot:
            access(table, [n])
    for n in range(1000, 1040):
        access(table, [n])
    return sum(access(table, [n]) for n in hot)


def test_a_scan_of_one_off_blocks_flushes_the_hot_set_from_lru() -> None:
    assert hot_blocks_kept(LRUPolicy(20)) == 0


@pytest.mark.parametrize("policy_class", [S3FIFOPolicy, ARCPolicy, KVFIFOPolicy])
def test_a_scan_resistant_policy_keeps_the_hot_set_through_a_scan_of_one_off_blocks(
    policy_class: type[EvictionPolicy],
) -> None:
    assert hot_blocks_kept(policy_class(20)) == 8


@pytest.mark.parametrize("policy_class", POLICIES)
def test_the_pool_never_evicts_a_block_being_loaded_or_saved(
    policy_class: type[EvictionPolicy],
) -> None:
    table = SlotTable(4, policy=policy_class(4))
    access(table, [1, 2])
    table.start_load(0, [h(1)])  # being loaded
    table.prepare_save(0, [h(3)])  # being saved
    table.complete_save(0, [h(2)])
    # Hot enough to pass over the pinned ones many times.
    for n in range(10, 60):
        table.prepare_save(0, [h(n)])
        table.complete_save(0, [h(n)])
    assert table.count_ready_prefix(0, [h(1)]) == 1
    assert table.holds(0, h(3)) and table.count_ready_prefix(0, [h(3)]) == 0
    # Every slot pinned: nothing more is placed.
    table.prepare_save(0, [h(100)])
    table.start_load(0, [h(59)])
    assert table.prepare_save(0, [h(101), h(102)]) == []


class _Recording(LRUPolicy):
    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.blocks: list[Hashable] = []

    def insert(self, slot: int, block: Hashable) -> None:
        self.blocks.append(block)
        super().insert(slot, block)


def test_the_slot_table_names_each_entry_by_its_group_and_hash() -> None:
    policy = _Recording(4)
    table = SlotTable(4, num_groups=2, policy=policy)
    table.prepare_save(0, [h(1)])
    table.prepare_save(1, [h(1)])
    assert policy.blocks == [(0, h(1)), (1, h(1))]


@pytest.mark.parametrize("policy_class", POLICIES)
def test_freed_slots_leave_the_policy(policy_class: type[EvictionPolicy]) -> None:
    policy = policy_class(2)
    table = SlotTable(2, policy=policy)
    table.prepare_save(0, [h(1)])
    table.abandon_save(0, [h(1)])
    assert len(policy) == 0
    access(table, [2])
    table.discard(0, [h(2)])
    assert len(policy) == 0
    access(table, [3, 4])
    assert len(policy) == 2
    assert table.clear()
    assert len(table) == len(policy) == 0


def test_arc_evicts_an_entry_used_once_before_one_used_again() -> None:
    policy = filled(ARCPolicy(4), 4)
    policy.hit(0)
    assert _drained(policy) == [1, 2, 3, 0]


def test_arc_frequent_list_is_least_recently_used_first() -> None:
    policy = filled(ARCPolicy(3), 3)
    for slot in (2, 0, 1, 2):
        policy.hit(slot)
    assert _drained(policy) == [0, 1, 2]


def test_arc_grows_the_recent_share_when_a_block_it_evicted_returns() -> None:
    policy = filled(ARCPolicy(4), 4)
    policy.hit(2)
    policy.hit(3)
    assert policy.victim(anything) == 0  # recent holds more than its target (0)
    policy.insert(0, ("block", 0))  # remembered: recent was evicted from too early
    assert policy._target == 1
    # Recent (1) holds no more than its target now: the frequent list gives up its oldest.
    assert policy.victim(anything) == 2


def test_arc_ghost_lists_are_bounded_by_the_slots() -> None:
    policy = ARCPolicy(8)
    for n in range(1000):
        policy.insert(n % 8, n)
        if n % 3 == 0:
            policy.hit(n % 8)
        assert policy.victim(anything) is not None
    assert len(policy._recent_ghosts) + len(policy._frequent_ghosts) <= 8


def test_kvfifo_evicts_an_entry_used_once_before_one_used_again() -> None:
    policy = filled(KVFIFOPolicy(10), 10)
    assert policy.small_target == 3
    policy.hit(0)
    # Entry 0 was used again: it moves to the main queue; 1, never used again, leaves.
    assert policy.victim(anything) == 1
    # The small queue gives up its entries down to its target, then the main queue goes.
    assert _drained(policy) == [*range(2, 8), 0, 8, 9]


def test_kvfifo_puts_a_continuing_entry_in_the_main_queue() -> None:
    policy = KVFIFOPolicy(10)
    policy.insert_continuing(0, "turn")
    for slot in range(1, 10):
        policy.insert(slot, ("one-off", slot))
    # The next turn's block waits in the main queue; the small queue's one-off entries go
    # first, down to the small queue's target (3).
    assert _drained(policy) == [*range(1, 8), 0, 8, 9]


def test_kvfifo_grows_the_small_queue_when_a_block_it_evicted_from_it_returns() -> None:
    policy = KVFIFOPolicy(100)
    filled(policy, 100)
    assert policy.small_target == 30
    assert policy.victim(anything) == 0  # leaves the small queue, unused: a ghost
    policy.insert(0, ("block", 0))
    assert policy.small_target == 31
    # It came back to the main queue: the small queue's entries still go first.
    assert policy.victim(anything) == 1


def test_kvfifo_shrinks_the_small_queue_when_a_block_it_evicted_from_main_returns() -> None:
    policy = KVFIFOPolicy(100)
    policy.insert_continuing(0, "main")
    policy.insert(1, "small")
    # The small queue holds less than its target: the main queue's oldest goes, unused.
    assert policy.victim(anything) == 0
    policy.insert(0, "main")  # back from the main queue's ghosts, into main
    assert policy.small_target == 29
    assert _drained(policy) == [0, 1]  # the small queue, below its target, goes last


def test_kvfifo_small_queue_target_stays_within_its_bounds() -> None:
    policy = KVFIFOPolicy(200)
    for n in range(2000):
        policy.insert(0, n % 3)
        assert policy.victim(anything) == 0
    assert 2 <= policy.small_target <= 199


def test_kvfifo_ghost_queues_are_bounded_by_the_slots_and_half_as_many_more() -> None:
    policy = KVFIFOPolicy(8)
    for n in range(1000):
        policy.insert(n % 8, n)
        if n % 3 == 0:
            policy.hit(n % 8)
        assert policy.victim(anything) is not None
    assert len(policy._small_ghosts) <= 8
    assert len(policy._main_ghosts) <= 12


def test_kvfifo_main_queue_moves_an_entry_used_again_to_its_end() -> None:
    policy = KVFIFOPolicy(3)
    for slot in range(3):
        policy.insert_continuing(slot, ("turn", slot))
    policy.hit(1)
    policy.hit(0)
    # Both used again, 0 last: a FIFO order would still give up 0 before 1.
    assert _drained(policy) == [2, 1, 0]


class _Strict(LRUPolicy):
    """Refuses an insertion of a slot it already orders."""

    def insert(self, slot: int, block: Hashable) -> None:
        assert slot not in self._order, f"slot {slot} inserted twice"
        super().insert(slot, block)


def test_a_save_that_evicts_a_block_it_touched_tells_the_policy_of_each_slot_once() -> None:
    policy = _Strict(2)
    table = SlotTable(2, policy=policy)
    for n in (1, 2):
        table.prepare_save(0, [h(n)])
        table.complete_save(0, [h(n)])
    # h(2) is touched; h(3) evicts h(1), then h(4) evicts h(2) (the policy hears of
    # this save's blocks at its end): h(2)'s slot is touched, then taken again.
    placed = table.prepare_save(0, [h(2), h(3), h(4)])
    assert [block for block, _ in placed] == [h(3), h(4)]
    assert len(policy) == 2


def test_a_save_given_a_hash_twice_inserts_its_slot_once() -> None:
    policy = _Strict(4)
    table = SlotTable(4, policy=policy)
    assert [block for block, _ in table.prepare_save(0, [h(1), h(1)])] == [h(1)]
    assert len(policy) == 1


class _Continuing(LRUPolicy):
    """Records which insertions came with the continuation hint."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.inserted: list[tuple[Hashable, bool]] = []

    def insert(self, slot: int, block: Hashable) -> None:
        self.inserted.append((block, False))
        super().insert(slot, block)

    def insert_continuing(self, slot: int, block: Hashable) -> None:
        self.inserted.append((block, True))
        super().insert(slot, block)


def request(index: CPUPoolIndex, numbers: list[int]) -> None:
    hashes = [h(n) for n in numbers]
    held = index.count_held_prefix(0, hashes)
    if held:
        index.prepare_load(0, hashes[:held])
        index.complete_load(0, hashes[:held], ())
    placed = [block for block, _ in index.prepare_save(0, hashes[held:])]
    index.complete_save(0, placed, success=True)


def test_the_pool_hints_the_blocks_of_a_prompt_that_grows_an_earlier_prompt() -> None:
    policy = _Continuing(16)
    index = CPUPoolIndex(16, 1, "cpu", policy=policy)
    request(index, [1, 2, 3])  # a first turn
    request(index, [1, 2, 4])  # shares 1 and 2, but no prompt ended at 2: not continuing
    request(index, [1, 2, 3, 5, 6])  # the first turn's next turn
    assert policy.inserted == [
        ((0, h(n)), continuing)
        for n, continuing in [(3, False), (2, False), (1, False), (4, False), (6, True), (5, True)]
    ]


def test_a_policy_without_the_hint_is_told_insert() -> None:
    policy = _Recording(16)
    index = CPUPoolIndex(16, 1, "cpu", policy=policy)
    request(index, [1, 2])
    request(index, [1, 2, 3])
    assert policy.blocks == [(0, h(2)), (0, h(1)), (0, h(3))]
