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
from kvwire.media.tiered.index import MISSING, TieredIndex, tier_of_write, tier_write_name
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


def test_write_through_places_the_blocks_in_the_tier_and_publishes_them_once_every_rank_wrote():
    tier = PlacingIndex()
    index = TieredIndex(
        8, 1, "cpu", tiers=[tier], write_through=True, found_by_key=[False], ranks=2
    )
    pool_slots = saved(index, hashes(1, 2))
    (write,) = index.take_spills()
    assert tier_of_write(write.request_id) == 1
    assert write.block_ids == tuple(pool_slots)  # read from the pool's slots
    assert write.block_hashes == tuple(hashes(1, 2))
    assert write.slots == (0, 1)  # written where the tier placed them
    assert index.take_spills() == []  # each block once

    index.complete_spills([(write.request_id, True)])
    assert tier.completions == []  # one rank of two: not published yet
    assert index.count_held_prefix(0, hashes(1, 2)) == 2  # the pool's own hits meanwhile
    index.complete_spills([(write.request_id, True)])
    assert tier.completions == [(tuple(hashes(1, 2)), True)]
    assert tier.published == {hashes(1)[0]: 0, hashes(2)[0]: 1}
    # A report of a write no longer awaited changes nothing.
    index.complete_spills([(write.request_id, False), ("tier1/999", False)])
    assert tier.completions == [(tuple(hashes(1, 2)), True)]


def test_a_write_one_rank_did_not_make_is_never_published_and_its_places_are_freed():
    tier = PlacingIndex(num_slots=2)
    index = TieredIndex(
        8, 1, "cpu", tiers=[tier], write_through=True, found_by_key=[False], ranks=2
    )
    saved(index, hashes(1, 2))
    (write,) = index.take_spills()
    index.complete_spills([(write.request_id, False), (write.request_id, True)])
    assert tier.completions == [(tuple(hashes(1, 2)), False)]
    assert tier.published == {}
    assert sorted(tier.free) == [0, 1]
    assert index.take_counters()["tier1.writes_not_made"] == 2


def test_a_block_saved_again_is_not_written_again():
    tier = PlacingIndex()
    index = TieredIndex(8, 1, "cpu", tiers=[tier], write_through=True, found_by_key=[False])
    saved(index, hashes(1))
    (write,) = index.take_spills()
    index.complete_spills([(write.request_id, True)])
    # Already ready in the pool: its save is only a refresh, nothing to write.
    index.complete_save(0, hashes(1), success=True)
    assert index.take_spills() == []


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


def test_write_names_round_trip_and_other_names_are_no_tiers_writes():
    assert tier_of_write(tier_write_name(3, 17)) == 3
    for name in ("", "req-1", "tier/1", "tierx/1", "tier1/", "tier1/x", "tier1"):
        assert tier_of_write(name) is None


def test_the_flags_must_match_the_tiers():
    with pytest.raises(ValueError, match="found_by_key has 2 flags for 1 tiers"):
        TieredIndex(4, 1, "cpu", tiers=[SetIndex(set())], write_through=True, found_by_key=[1, 0])
    with pytest.raises(ValueError, match="ranks must be >= 1"):
        TieredIndex(4, 1, "cpu", tiers=[SetIndex(set())], write_through=True, ranks=0)
