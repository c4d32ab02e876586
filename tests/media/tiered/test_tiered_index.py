"""The tiered medium's scheduler half: lookups across tiers, promotion slots, spills, events."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest

from kvwire.blocks.transfers import TransferPayload
from kvwire.interface.types import BlockHash, BlockStored
from kvwire.media.admission import SaveAdmission
from kvwire.media.base import LoadSpec, MediumIndex
from kvwire.media.tiered.index import Place, SpilledBlocks, Spills, TieredIndex, TieredLoad

POOL, ARRIVING, TIER, MISSING = Place.POOL, Place.ARRIVING, Place.TIER, Place.MISSING
DIRECT = Place.DIRECT


class SetIndex(MediumIndex):
    """A tier's index over a set of hashes (group 0), found by key."""

    concurrent_lookups = True

    def __init__(self, held: set[BlockHash]) -> None:
        self.held = held
        self.completed: list[tuple[BlockHash, ...]] = []

    def count_held_prefix(self, group: int, block_hashes: Sequence[BlockHash]) -> int:
        count = 0
        for block_hash in block_hashes:
            if block_hash not in self.held:
                break
            count += 1
        return count

    def complete_load(
        self,
        group: int,
        block_hashes: Sequence[BlockHash],
        corrupt: Sequence[BlockHash],
        payload: TransferPayload | None = None,
    ) -> None:
        self.completed.append(tuple(block_hashes))


def hashes(*names: int) -> list[BlockHash]:
    return [bytes([name]) * 8 for name in names]


def places(spec: LoadSpec) -> tuple[Place, ...]:
    """Where the load `spec` was prepared for reads each block."""
    assert isinstance(spec.payload, TieredLoad)
    return spec.payload.places


def complete(
    index: TieredIndex, spec: LoadSpec, blocks: list[BlockHash], corrupt: Sequence[BlockHash] = ()
) -> None:
    index.complete_load(0, blocks, corrupt, payload=spec.payload)


def saved(index: TieredIndex, blocks: list[BlockHash]) -> list[int]:
    placed = index.prepare_save(0, blocks)
    index.complete_save(0, [h for h, _ in placed], success=True)
    return [slot for _, slot in placed if slot is not None]


def test_a_lookup_extends_the_pools_prefix_with_each_tier_in_turn():
    tier1, tier2 = SetIndex(set(hashes(3))), SetIndex(set(hashes(4, 5)))
    index = TieredIndex(8, 1, "cpu", tiers=[tier1, tier2], write_through=False)
    saved(index, hashes(1, 2))
    assert index.count_held_prefix(0, hashes(1, 2, 3, 4, 5, 6)) == 5
    # A block no tier holds ends the prefix, even if a later tier holds what follows.
    assert index.count_held_prefix(0, hashes(1, 7, 4)) == 1


def test_a_block_the_pool_holds_after_a_tier_s_blocks_is_counted_and_the_lookup_goes_on():
    # The pool holds blocks 1 and 3 (and is full); the tier 2 and 4: a lookup that
    # stopped at block 3 would have vLLM compute blocks 3 and 4 again.
    tier = SetIndex(set(hashes(2, 4)))
    index = TieredIndex(4, 1, "cpu", tiers=[tier], write_through=False)
    saved(index, hashes(1))
    saved(index, hashes(3))
    saved(index, hashes(8, 9))
    wanted = hashes(1, 2, 3, 4)
    assert index.count_held_prefix(0, wanted) == 4
    # Block 3 is pinned before the promotions evict: they take blocks 8 and 9's slots.
    spec = index.prepare_load(0, wanted)
    assert places(spec) == (POOL, TIER, POOL, TIER)
    assert "load_blocks_missing" not in index.take_counters()
    complete(index, spec, wanted)
    assert index.pool.count_held_prefix(0, wanted) == 4
    # A block no tier holds ends the prefix after the pool's block, too.
    assert index.count_held_prefix(0, hashes(1, 2, 3, 7)) == 3


def test_a_load_pins_the_pools_blocks_and_brings_the_tiers_blocks_into_new_slots():
    tier = SetIndex(set(hashes(3, 4)))
    index = TieredIndex(8, 1, "cpu", tiers=[tier], write_through=False)
    pool_slots = saved(index, hashes(1, 2))
    wanted = hashes(1, 2, 3, 4)
    assert index.count_held_prefix(0, wanted) == 4
    spec = index.prepare_load(0, wanted)
    assert list(spec.slots[:2]) == pool_slots
    assert len(set(spec.slots)) == 4
    assert places(spec) == (POOL, POOL, TIER, TIER)
    # Not hits until the load ends; then hits of the pool, with a stored event.
    # Being brought in: no other load can have it until this one is done.
    assert index.count_held_prefix(0, hashes(3)) == 0
    assert index.pool.count_held_prefix(0, hashes(3)) == 0
    index.take_events()
    complete(index, spec, wanted)
    assert index.pool.count_held_prefix(0, hashes(3, 4)) == 2
    events = index.take_events()
    assert events == [BlockStored(block_hashes=tuple(hashes(3, 4)), medium="cpu", group=0)]
    assert index.take_counters()["tier1.promoted_blocks"] == 2
    assert tier.completed == [tuple(hashes(3, 4))]


def test_a_block_brought_in_that_failed_is_forgotten_and_its_slot_freed():
    tier = SetIndex(set(hashes(3, 4)))
    index = TieredIndex(2, 1, "cpu", tiers=[tier], write_through=False)
    wanted = hashes(3, 4)
    index.count_held_prefix(0, wanted)
    complete(index, index.prepare_load(0, wanted), wanted, hashes(4))
    assert index.pool.count_held_prefix(0, wanted) == 1
    assert not index.pool.holds(0, hashes(4)[0])


def test_the_blocks_a_promotion_evicts_count_as_evicted_and_a_failed_one_s_do_not():
    tier = SetIndex(set(hashes(3, 4)))
    index = TieredIndex(2, 1, "cpu", tiers=[tier], write_through=False)
    saved(index, hashes(1, 2))
    assert "evicted_blocks" not in index.take_counters()
    wanted = hashes(3, 4)
    index.count_held_prefix(0, wanted)
    spec = index.prepare_load(0, wanted)  # evicts blocks 1 and 2 to bring 3 and 4 in
    # Block 4 fails its read: forgotten, which is no eviction.
    complete(index, spec, wanted, hashes(4))
    assert index.take_counters()["evicted_blocks"] == 2
    assert not index.pool.holds(0, hashes(4)[0])


@pytest.mark.parametrize("spill_buffers", [0, 2])
def test_a_block_that_left_the_pool_after_the_lookup_is_missing_not_an_error(
    spill_buffers: int,
) -> None:
    tier = SetIndex(set())
    index = TieredIndex(1, 1, "cpu", tiers=[tier], write_through=False, spill_buffers=spill_buffers)
    saved(index, hashes(1))
    wanted = hashes(1)
    assert index.count_held_prefix(0, wanted) == 1
    saved(index, hashes(2))  # evicts block 1: the only slot
    spec = index.prepare_load(0, wanted)
    assert places(spec) == (MISSING,)
    # Past the slot and every spill buffer: no entry of the pool's memory stands for it.
    assert spec.slots == (1 + spill_buffers,)
    complete(index, spec, wanted, wanted)


def test_spill_writes_each_evicted_block_no_tier_holds_once():
    tier = SetIndex(set(hashes(1)))
    index = TieredIndex(2, 1, "cpu", tiers=[tier], write_through=False)
    # Block 1 comes from the tier (clean), block 2 is computed here (only the pool has it).
    index.count_held_prefix(0, hashes(1))
    complete(index, index.prepare_load(0, hashes(1)), hashes(1))
    slot_of_2 = saved(index, hashes(2))[0]
    saved(index, hashes(3, 4))  # evicts both
    assert index.take_step_payload() == Spills((SpilledBlocks(0, tuple(hashes(2)), (slot_of_2,)),))
    assert index.take_step_payload() is None


def test_the_blocks_a_promotion_evicts_are_spilled_first_in_a_record_of_their_own():
    tier = SetIndex(set(hashes(9)))
    index = TieredIndex(2, 1, "cpu", tiers=[tier], write_through=False)
    slot_of_1, slot_of_2 = saved(index, hashes(1)) + saved(index, hashes(2))
    saved(index, hashes(3))  # evicts block 1 for a save
    index.count_held_prefix(0, hashes(9))
    spec = index.prepare_load(0, hashes(9))  # evicts block 2 to bring block 9 in
    assert places(spec) == (TIER,)
    assert spec.slots == (slot_of_2,)

    # The promotion waits for the write of its own slot only: that write comes first.
    assert index.take_step_payload() == Spills(
        (
            SpilledBlocks(0, tuple(hashes(2)), (slot_of_2,), for_promotion=True),
            SpilledBlocks(0, tuple(hashes(1)), (slot_of_1,), for_promotion=False),
        )
    )
    complete(index, spec, hashes(9))
    assert index.take_step_payload() is None


def test_write_through_marks_saved_blocks_held_by_the_tiers_so_eviction_spills_nothing():
    index = TieredIndex(2, 1, "cpu", tiers=[SetIndex(set())], write_through=True)
    saved(index, hashes(1, 2))
    saved(index, hashes(3, 4))
    assert index.take_step_payload() is None


def test_a_tier_that_raises_or_answers_nonsense_is_a_miss_and_later_tiers_still_answer():
    class Raising(SetIndex):
        def count_held_prefix(self, group: int, block_hashes: Sequence[BlockHash]) -> int:
            raise ConnectionError("redis://:secret@host down")

    index = TieredIndex(
        4, 1, "cpu", tiers=[Raising(set()), SetIndex(set(hashes(1)))], write_through=False
    )
    assert index.count_held_prefix(0, hashes(1)) == 1
    counters = index.take_counters()
    assert counters["tier1.lookups"] == 1
    assert counters["tier2.lookups"] == 1


def test_each_tiers_lookup_delay_is_counted_in_cumulative_buckets():
    index = TieredIndex(4, 1, "cpu", tiers=[SetIndex(set())], write_through=False)
    for _ in range(3):
        index.count_held_prefix(0, hashes(1))
    counters = index.take_counters()
    assert counters["tier1.lookups"] == 3
    assert counters["tier1.lookups_le_100ms"] == 3
    assert counters["tier1.lookups_le_1ms"] <= counters["tier1.lookups_le_10ms"] <= 3
    assert counters["tier1.lookup_microseconds"] >= 0


class GatedTier(SetIndex):
    """A tier whose every lookup waits until `release` is set (bounded, so a bug cannot hang)."""

    def __init__(self, held: set[BlockHash]) -> None:
        super().__init__(held)
        self.release = threading.Event()

    def count_held_prefix(self, group: int, block_hashes: Sequence[BlockHash]) -> int:
        self.release.wait(timeout=30)
        return super().count_held_prefix(group, block_hashes)


def test_an_async_lookup_of_a_stuck_tier_answers_at_once_and_never_blocks_the_scheduler():
    from kvwire.blocks.groups import CacheGroup
    from kvwire.connectors.offload._planner import BlockPlanner
    from kvwire.connectors.offload.scheduler import OffloadSchedulerHalf
    from kvwire.interface.types import Request

    tier = GatedTier(set(hashes(1, 2, 3)))
    index = TieredIndex(8, 1, "cpu", tiers=[tier], write_through=False)
    planner = BlockPlanner(4, [CacheGroup(0, ("layers.0",), 4)], loads=True, saves=True)
    half = OffloadSchedulerHalf(
        index=index, planner=planner, num_groups=1, async_load=False, lookup_deadline_s=600
    )
    request = Request(
        request_id="r", prompt_token_ids=list(range(13)), max_tokens=1, block_hashes=hashes(1, 2, 3)
    )
    try:
        # The tier is stuck: every ask answers "not yet" at once, on the scheduler's thread.
        for _ in range(3):
            assert half.get_num_new_matched_tokens(request, 0) == (None, False)
        tier.release.set()
        for _ in range(2000):
            answer = half.get_num_new_matched_tokens(request, 0)
            if answer[0] is not None:
                break
            time.sleep(0.005)
        assert answer == (12, False)
    finally:
        tier.release.set()
        half.close()


def test_a_lookup_counts_no_more_tier_blocks_than_the_pool_has_slots_to_bring_them_into():
    tier = SetIndex(set(hashes(1, 2, 3, 4, 5, 6)))
    index = TieredIndex(4, 1, "cpu", tiers=[tier], write_through=False)
    assert index.count_held_prefix(0, hashes(1, 2, 3, 4, 5, 6)) == 4
    saved(index, hashes(9))
    index.prepare_load(0, hashes(9))  # a load in flight pins one slot
    assert index.count_held_prefix(0, hashes(1, 2, 3, 4, 5, 6)) == 3
    assert MISSING not in places(index.prepare_load(0, hashes(1, 2, 3)))
    assert "load_blocks_missing" not in index.take_counters()


def test_a_block_the_pool_is_still_saving_ends_the_prefix_though_a_tier_holds_it():
    # Written through: the tier has the block before the pool's save is published.
    tier = SetIndex(set(hashes(1, 2, 3)))
    index = TieredIndex(8, 1, "cpu", tiers=[tier], write_through=True)
    saved(index, hashes(1))
    index.prepare_save(0, hashes(2))  # not complete: the pool holds it, not ready
    assert index.count_held_prefix(0, hashes(1, 2, 3)) == 1
    index.complete_save(0, hashes(2), success=True)
    assert index.count_held_prefix(0, hashes(1, 2, 3)) == 3
    assert MISSING not in places(index.prepare_load(0, hashes(1, 2, 3)))


def test_lookups_of_requests_that_share_a_first_block_each_load_what_they_counted():
    # Two requests share blocks 1 and 2, then part; both are looked up before
    # either is loaded (as async_lookup does): one's lookup must not stand in for the other's.
    tier = SetIndex(set(hashes(1, 2, 3)))
    index = TieredIndex(8, 1, "cpu", tiers=[tier], write_through=False)
    longer, shorter = hashes(1, 2, 3), hashes(1, 2, 9)
    assert index.count_held_prefix(0, longer) == 3
    assert index.count_held_prefix(0, shorter) == 2
    assert places(index.prepare_load(0, longer)) == (TIER,) * 3
    assert "load_blocks_missing" not in index.take_counters()


def test_a_load_of_blocks_another_load_brings_in_shares_their_slots():
    tier = SetIndex(set(hashes(1, 2)))
    index = TieredIndex(8, 1, "cpu", tiers=[tier], write_through=False)
    wanted = hashes(1, 2)
    # Both counted before either load was prepared.
    assert index.count_held_prefix(0, wanted) == index.count_held_prefix(0, wanted) == 2
    first = index.prepare_load(0, wanted)
    assert places(first) == (TIER, TIER)
    second = index.prepare_load(0, wanted)
    assert places(second) == (ARRIVING, ARRIVING)
    assert second.slots == first.slots
    assert "load_blocks_missing" not in index.take_counters()


def test_a_shared_block_is_a_hit_once_every_load_of_it_ended_whichever_ends_first():
    for sharing_ends_first in (False, True):
        tier = SetIndex(set(hashes(1, 2, 3)))
        index = TieredIndex(8, 1, "cpu", tiers=[tier], write_through=False)
        bringing, sharing = hashes(1, 2), hashes(1, 2, 3)
        index.count_held_prefix(0, sharing)
        loads = {
            "bringing": (bringing, index.prepare_load(0, bringing)),
            "sharing": (sharing, index.prepare_load(0, sharing)),
        }
        assert places(loads["sharing"][1]) == (ARRIVING, ARRIVING, TIER)
        index.take_events()
        order = ("sharing", "bringing") if sharing_ends_first else ("bringing", "sharing")
        blocks, spec = loads[order[0]]
        complete(index, spec, blocks)
        assert index.pool.count_held_prefix(0, bringing) == 0
        blocks, spec = loads[order[1]]
        complete(index, spec, blocks)
        assert index.pool.count_held_prefix(0, sharing) == 3
        assert index.pool.busy_slots == 0
        stored = [h for event in index.take_events() for h in event.block_hashes]
        assert sorted(stored) == sharing  # each block once
        assert index.take_counters()["tier1.promoted_blocks"] == 3
        # The tier was read once per block: by the load that brought it in.
        assert sorted(h for load in tier.completed for h in load) == sharing


def test_a_shared_block_that_failed_is_forgotten_once_no_load_reads_its_slot():
    tier = SetIndex(set(hashes(1, 2)))
    index = TieredIndex(2, 1, "cpu", tiers=[tier], write_through=False)
    wanted = hashes(1, 2)
    index.count_held_prefix(0, wanted)
    bringing = index.prepare_load(0, wanted)
    sharing = index.prepare_load(0, wanted)
    complete(index, bringing, wanted, hashes(2))
    # The sharing load still reads block 2's slot: nothing may be saved into it yet.
    assert index.prepare_save(0, hashes(7)) == []
    complete(index, sharing, wanted, hashes(2))
    assert index.pool.count_held_prefix(0, wanted) == 1
    assert index.pool.busy_slots == 0
    assert [h for h, _ in index.prepare_save(0, hashes(7))] == hashes(7)


def test_no_block_stays_pinned_after_loads_that_failed_and_loads_that_shared_them():
    tier = SetIndex(set(hashes(1, 2, 3, 4)))
    index = TieredIndex(4, 1, "cpu", tiers=[tier], write_through=False)
    wanted = hashes(1, 2, 3, 4)
    for corrupt in (wanted, hashes(3), ()):
        index.count_held_prefix(0, wanted)
        bringing = index.prepare_load(0, wanted)
        sharing = index.prepare_load(0, wanted)
        complete(index, bringing, wanted, corrupt)
        complete(index, sharing, wanted)
        assert index.pool.busy_slots == 0
    assert index.pool.count_held_prefix(0, wanted) == 4
    assert index._arriving_from == {}


class PinningIndex(SetIndex):
    """A tier's index that pins slots for its loads, as no secondary tier's may."""

    def prepare_load(self, group: int, block_hashes: Sequence[BlockHash]) -> LoadSpec:
        return LoadSpec(slots=tuple(range(len(block_hashes))))


def test_a_tier_whose_loads_pin_slots_gives_missing_blocks_and_is_unpinned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tier = PinningIndex(set(hashes(5)))
    index = TieredIndex(4, 1, "cpu", tiers=[tier], write_through=False)
    assert index.count_held_prefix(0, hashes(5)) == 1
    spec = index.prepare_load(0, hashes(5))
    assert places(spec) == (MISSING,)
    assert tier.completed == [tuple(hashes(5))]
    assert "pinned slots" in caplog.text
    complete(index, spec, hashes(5))
    assert index.pool.busy_slots == 0


def test_a_piece_of_a_load_carries_its_blocks_places_and_its_part_of_each_tiers_span():
    tier1, tier2 = SetIndex(set(hashes(2, 3))), SetIndex(set(hashes(4)))
    index = TieredIndex(8, 1, "cpu", tiers=[tier1, tier2], write_through=False)
    saved(index, hashes(1))
    wanted = hashes(1, 2, 3, 4)
    assert index.count_held_prefix(0, wanted) == 4
    payload = index.prepare_load(0, wanted).payload
    assert isinstance(payload, TieredLoad)
    assert [(s.tier, s.start, s.stop) for s in payload.spans] == [(1, 1, 3), (2, 3, 4)]
    piece = payload.part(2, 4)
    assert piece.ticket == payload.ticket
    assert piece.places == (TIER, TIER)
    assert [(s.tier, s.start, s.stop) for s in piece.spans] == [(1, 0, 1), (2, 1, 2)]
    assert payload.part(0, 1).spans == ()


def test_without_promotion_tier_blocks_take_no_slot_and_a_lookup_is_not_bounded_by_slots():
    tier = SetIndex(set(hashes(2, 3, 4, 5, 6)))
    index = TieredIndex(2, 1, "cpu", tiers=[tier], write_through=False, promotes=False)
    saved(index, hashes(1))
    # Two slots, yet every block the tier holds counts: none needs a slot.
    assert index.count_held_prefix(0, hashes(1, 2, 3, 4, 5, 6)) == 6
    spec = index.prepare_load(0, hashes(1, 2, 3, 4, 5, 6))
    assert places(spec) == (POOL, DIRECT, DIRECT, DIRECT, DIRECT, DIRECT)
    assert isinstance(spec.payload, TieredLoad)
    (span,) = spec.payload.spans
    assert (span.tier, span.start, span.stop, span.direct) == (1, 1, 6, True)
    # The slot past the pool's memory: never read.
    assert spec.slots[1:] == (2,) * 5
    complete(index, spec, hashes(1, 2, 3, 4, 5, 6))
    counters = index.take_counters()
    assert counters["tier1.direct_blocks"] == 5
    assert "tier1.promoted_blocks" not in counters
    assert tier.completed == [tuple(hashes(2, 3, 4, 5, 6))]  # told its load ended
    # The pool kept its own block and took in none of the tier's.
    assert index.count_held_prefix(0, hashes(1)) == 1
    assert not any(index.pool.holds(0, h) for h in hashes(2, 3, 4, 5, 6))


def test_write_around_gives_the_blocks_the_pool_refuses_the_slot_past_its_memory():
    tier = SetIndex(set())
    index = TieredIndex(
        4,
        1,
        "cpu",
        tiers=[tier],
        write_through=False,
        admission=SaveAdmission(2, 1024),
        write_around=True,
    )
    # First sight: the pool refuses all three; each is written around it (slot 4).
    assert index.prepare_save(0, hashes(1, 2, 3)) == [(h, 4) for h in hashes(1, 2, 3)]
    # Being written around: offered to neither again.
    assert index.prepare_save(0, hashes(1, 2, 3)) == []
    index.complete_save(0, hashes(1, 2, 3), success=True)
    # The pool holds none of them: the tier does, by key.
    assert not any(index.pool.holds(0, h) for h in hashes(1, 2, 3))
    # Seen again: admitted into the pool's slots, nothing around it.
    placed = index.prepare_save(0, hashes(1, 2))
    assert [slot < 4 for _, slot in placed] == [True, True]
    index.complete_save(0, hashes(1, 2), success=True)
    assert index.count_held_prefix(0, hashes(1, 2)) == 2
    # A write around the pool that failed is forgotten: offered again next time.
    assert index.prepare_save(0, hashes(7)) == [(hashes(7)[0], 4)]
    index.complete_save(0, hashes(7), success=False)
    assert index.prepare_save(0, hashes(7)) != []


def test_without_write_around_the_blocks_the_pool_refuses_are_saved_nowhere():
    index = TieredIndex(
        4, 1, "cpu", tiers=[SetIndex(set())], write_through=False, admission=SaveAdmission(2, 1024)
    )
    assert index.prepare_save(0, hashes(1, 2, 3)) == []
