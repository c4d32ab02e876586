"""A secondary tier whose index places each block (the peer medium's kind), in the tiered index.

Its writes are named spills at the places its `prepare_save` gave; it
publishes them (`complete_save`) once every worker reported the write ended,
and never when one of them did not make it.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvwire.interface.types import BlockHash
from kvwire.media.base import MediumIndex
from kvwire.media.tiered.index import (
    MISSING,
    TieredIndex,
    places_source,
    source_places,
    tier_of_write,
    tier_write_name,
)
from tests.media.tiered.test_tiered_index import SetIndex, hashes, saved


class PlacingIndex(MediumIndex):
    """A tier's index that gives each new block a slot and publishes it when its save is made."""

    def __init__(self, num_slots: int = 64) -> None:
        self.free = list(range(num_slots))
        self.saving: dict[BlockHash, int] = {}
        self.published: dict[BlockHash, int] = {}
        self.completions: list[tuple[tuple[BlockHash, ...], bool]] = []
        self.pins_loads = False

    def count_held_prefix(self, group: int, block_hashes: Sequence[BlockHash]) -> int:
        count = 0
        for block_hash in block_hashes:
            if block_hash not in self.published:
                break
            count += 1
        return count

    def prepare_load(self, group: int, block_hashes: Sequence[BlockHash]) -> tuple[int, ...]:
        if self.pins_loads:
            return tuple(self.published[h] for h in block_hashes)
        return ()

    def load_sources(self, group: int, block_hashes: Sequence[BlockHash]) -> tuple[str, ...]:
        return tuple(f"at{self.published[h]}" for h in block_hashes)

    def prepare_save(
        self, group: int, block_hashes: Sequence[BlockHash]
    ) -> list[tuple[BlockHash, int | None]]:
        placed: list[tuple[BlockHash, int | None]] = []
        for block_hash in block_hashes:
            if block_hash in self.published or block_hash in self.saving or not self.free:
                continue
            slot = self.free.pop(0)
            self.saving[block_hash] = slot
            placed.append((block_hash, slot))
        return placed

    def complete_save(
        self, group: int, block_hashes: Sequence[BlockHash], *, success: bool
    ) -> None:
        self.completions.append((tuple(block_hashes), success))
        for block_hash in block_hashes:
            slot = self.saving.pop(block_hash)
            if success:
                self.published[block_hash] = slot
            else:
                self.free.append(slot)


def test_write_through_places_each_saved_block_in_the_tier_and_publishes_it_with_the_save():
    tier = PlacingIndex()
    index = TieredIndex(8, 1, "cpu", tiers=[tier], write_through=True, found_by_key=[False])
    placed = index.prepare_save(0, hashes(1, 2))
    # The worker writes the tier as part of the save, at the places its index gave.
    assert index.save_sources(0, hashes(1, 2)) == ("1@0", "1@1")
    assert {source_places(s)[1] for s in index.save_sources(0, hashes(1, 2))} == {0, 1}
    assert index.take_spills() == []  # nothing else to write
    assert tier.completions == []
    index.complete_save(0, [h for h, _ in placed], success=True)
    assert tier.completions == [(tuple(hashes(1, 2)), True)]
    assert tier.published == {hashes(1)[0]: 0, hashes(2)[0]: 1}
    # Saved again: the pool holds them, nothing new is placed anywhere.
    assert index.prepare_save(0, hashes(1, 2)) == []
    assert index.save_sources(0, hashes(1, 2)) == ()


def test_a_save_not_made_frees_its_places_in_the_tier_too():
    tier = PlacingIndex(num_slots=2)
    index = TieredIndex(8, 1, "cpu", tiers=[tier], write_through=True, found_by_key=[False])
    index.prepare_save(0, hashes(1, 2))
    index.complete_save(0, hashes(1, 2), success=False)
    assert tier.completions == [(tuple(hashes(1, 2)), False)]
    assert tier.published == {} and sorted(tier.free) == [0, 1]
    assert index.take_counters()["tier1.writes_not_made"] == 2


def test_blocks_a_full_tier_cannot_place_are_saved_to_the_pool_alone():
    tier = PlacingIndex(num_slots=1)
    index = TieredIndex(8, 1, "cpu", tiers=[tier], write_through=True, found_by_key=[False])
    placed = index.prepare_save(0, hashes(1, 2))
    assert len(placed) == 2
    assert index.save_sources(0, hashes(1, 2)) == ("1@0", "")
    index.complete_save(0, hashes(1, 2), success=True)
    assert tier.published == {hashes(1)[0]: 0}


def test_a_spilled_write_is_published_once_every_rank_reported_it_and_never_if_one_failed():
    tier = PlacingIndex()
    index = TieredIndex(
        1, 1, "cpu", tiers=[tier], write_through=False, found_by_key=[False], ranks=2
    )
    saved(index, hashes(1))
    saved(index, hashes(2))  # evicts block 1
    (write,) = index.take_spills()
    index.complete_spills([(write.request_id, True)])
    assert tier.completions == []  # one rank of two
    index.complete_spills([(write.request_id, True)])
    assert tier.completions == [(tuple(hashes(1)), True)]
    # A report of a write no longer awaited changes nothing.
    index.complete_spills([(write.request_id, False), ("tier1/999", False)])
    assert tier.completions == [(tuple(hashes(1)), True)]

    saved(index, hashes(3))  # evicts block 2
    (write,) = index.take_spills()
    index.complete_spills([(write.request_id, False), (write.request_id, True)])
    assert tier.completions[-1] == (tuple(hashes(2)), False)
    assert hashes(2)[0] not in tier.published


def test_spill_writes_evicted_blocks_to_tiers_by_key_unnamed_and_to_placing_tiers_named():
    by_key, placing = SetIndex(set()), PlacingIndex()
    index = TieredIndex(
        2,
        1,
        "cpu",
        tiers=[by_key, placing],
        write_through=False,
        found_by_key=[True, False],
    )
    first = saved(index, hashes(1, 2))
    assert index.take_spills() == []  # nothing evicted yet: nothing written
    saved(index, hashes(3))  # evicts block 2 (a prefix goes from its tail)
    unnamed, named = index.take_spills()
    assert unnamed.request_id == "" and tier_of_write(unnamed.request_id) is None
    assert unnamed.block_hashes == named.block_hashes == tuple(hashes(2))
    assert unnamed.block_ids == named.block_ids == (first[1],)
    assert tier_of_write(named.request_id) == 2 and named.slots == (0,)
    index.complete_spills([(named.request_id, True)])
    assert placing.published == {hashes(2)[0]: 0}
    # Found in the placing tier: brought into the pool, read where its index says.
    assert index.count_held_prefix(0, hashes(1, 2)) == 2
    index.prepare_load(0, hashes(1, 2))
    assert index.load_sources(0, hashes(1, 2)) == ("", "2:at0")


def test_a_tier_whose_loads_pin_slots_gives_missing_blocks_and_is_unpinned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tier = PlacingIndex()
    tier.published = {hashes(5)[0]: 3}
    tier.pins_loads = True
    completed: list[Sequence[BlockHash]] = []
    tier.complete_load = lambda group, block_hashes, corrupt: completed.append(block_hashes)  # type: ignore[method-assign]
    index = TieredIndex(4, 1, "cpu", tiers=[tier], write_through=False, found_by_key=[False])
    assert index.count_held_prefix(0, hashes(5)) == 1
    index.prepare_load(0, hashes(5))
    assert index.load_sources(0, hashes(5)) == (MISSING,)
    assert completed == [hashes(5)]
    assert "pinned slots" in caplog.text


def test_places_round_trip_and_malformed_ones_name_no_place():
    assert source_places(places_source({2: 7, 1: 3})) == {1: 3, 2: 7}
    assert places_source({}) == ""
    for source in ("", "1", "1@", "@3", "x@3", "1@-3", "1@3@4"):
        assert source_places(source) == {}


def test_write_names_round_trip_and_other_names_are_no_tiers_writes():
    assert tier_of_write(tier_write_name(3, 17)) == 3
    for name in ("", "req-1", "tier/1", "tierx/1", "tier1/", "tier1/x", "tier1"):
        assert tier_of_write(name) is None


def test_the_flags_must_match_the_tiers():
    with pytest.raises(ValueError, match="found_by_key has 2 flags for 1 tiers"):
        TieredIndex(4, 1, "cpu", tiers=[SetIndex(set())], write_through=True, found_by_key=[1, 0])
    with pytest.raises(ValueError, match="ranks must be >= 1"):
        TieredIndex(4, 1, "cpu", tiers=[SetIndex(set())], write_through=True, ranks=0)
