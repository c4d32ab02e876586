"""The replay through the CPU pool's index, counted by hand, and Belady's optimum above it."""

from __future__ import annotations

import attrs
import pytest

from kvwire.interface.types import BlockHash
from kvwire.registry import ConnectorRegistry
from kvwire.replay.belady import belady_hit_counts, belady_hits
from kvwire.replay.pool import PoolReplay, replay_pool
from kvwire.replay.sweep import POLICIES, SAVE_THRESHOLDS, sweep
from kvwire.replay.synthetic import SHAPES, generate_trace
from kvwire.replay.trace import block_hash


def requests(*ids: list[int]) -> list[list[BlockHash]]:
    return [[block_hash(i) for i in request] for request in ids]


# A pool of 3 blocks, LRU, every block saved. Loads and saves tell the policy a
# prompt's last block first, so its first block is the most recently used.
# (Least recently used first.)
#   [1,2,3]  0 hits; saves 1 2 3                  order 3 2 1
#   [1,2,4]  2 hits (1 2); saves 4, evicts 3      order 2 1 4
#   [1,2,3]  2 hits (1 2); saves 3, evicts 4      order 2 1 3
#   [5]      0 hits; saves 5, evicts 2            order 1 3 5
#   [1,2]    1 hit (1); saves 2, evicts 3         order 5 1 2
#   [1,3]    1 hit (1); saves 3, evicts 5         order 2 1 3
HAND_MADE = requests([1, 2, 3], [1, 2, 4], [1, 2, 3], [5], [1, 2], [1, 3])


def test_lru_hits_the_prefixes_counted_by_hand() -> None:
    replay = replay_pool(HAND_MADE, 3, "lru", 1)
    assert (replay.asked_blocks, replay.hit_blocks) == (14, 6)
    assert (replay.saved_blocks, replay.evicted_blocks) == (8, 5)
    assert replay.hit_rate == 6 / 14
    assert replay.saves_not_admitted == 0


def test_a_save_threshold_of_2_saves_a_block_the_second_time_it_is_offered() -> None:
    # [1] offered: not saved. [1] again: saved. [1] a third time: a hit.
    replay = replay_pool(requests([1], [1], [1]), 4, "lru", 2)
    assert (replay.hit_blocks, replay.saved_blocks, replay.saves_not_admitted) == (1, 1, 1)


def test_a_save_choice_offers_the_pool_only_the_blocks_it_picks() -> None:
    # Only the first missed block is offered: [1, 2] saves 1; again, 1 hits and 2 is saved.
    replay = replay_pool(
        requests([1, 2], [1, 2]), 4, "lru", 1, choose_saves=lambda _, missed: missed[:1]
    )
    assert (replay.hit_blocks, replay.saved_blocks) == (1, 2)
    assert replay_pool(requests([1, 2], [1, 2]), 4, "lru", 1).hit_blocks == 2


def test_a_save_choice_that_is_not_a_prefix_is_refused_naming_the_request() -> None:
    with pytest.raises(ValueError, match=r"request 1's saves must be a prefix of its 2 missed"):
        replay_pool(requests([1], [2, 3]), 4, "lru", 1, choose_saves=lambda _, missed: missed[1:])


@pytest.mark.parametrize("shape", list(SHAPES))
def test_belady_bounds_every_policy_on_a_generated_trace(shape: str) -> None:
    trace = generate_trace(attrs.evolve(SHAPES[shape], requests=300))
    rows = sweep(trace, [16, 64, 256])
    assert {(row.policy, row.save_threshold) for row in rows} == {
        (policy, threshold) for policy in POLICIES for threshold in SAVE_THRESHOLDS
    }
    configurations = len(POLICIES) * len(SAVE_THRESHOLDS)
    assert [row.pool_blocks for row in rows] == [16] * configurations + [64] * configurations + [
        256
    ] * configurations
    accesses = [block for hashes in trace for block in hashes]
    for row in rows:
        assert row.belady_hit_rate == belady_hits(accesses, row.pool_blocks) / len(accesses)
        assert 0 < row.hit_rate <= row.belady_hit_rate
        assert row.ratio == pytest.approx(row.hit_rate / row.belady_hit_rate)
        assert row.asked_blocks == len(accesses)


def test_belady_at_several_sizes_counted_by_hand() -> None:
    # a b c a b c a. One block: a is kept for its next use (3, then 6), b and
    # c are refused. Two: a and b kept, c refused, then a and b hit and a
    # again. Three: every block from its second use.
    accesses = [block_hash(ord(letter)) for letter in "abcabca"]
    assert belady_hit_counts(accesses, [1, 2, 3]) == {1: 2, 2: 3, 3: 4}


def test_with_nothing_reused_the_ratio_is_none() -> None:
    [row] = sweep(requests([1], [2]), [4], policies=["lru"], save_thresholds=[1])
    assert (row.hit_rate, row.belady_hit_rate, row.ratio, row.blocks_written) == (0, 0, None, 2)


def test_worker_processes_give_the_rows_one_process_gives() -> None:
    trace = generate_trace(attrs.evolve(SHAPES["conversation"], requests=60))
    seen: list[PoolReplay] = []
    rows = sweep(trace, [32, 128], policies=("lru", "kvfifo"), jobs=2, on_replayed=seen.append)
    alone = sweep(trace, [32, 128], policies=("lru", "kvfifo"))
    drop_seconds = [attrs.evolve(row, seconds=0.0) for row in rows]
    assert drop_seconds == [attrs.evolve(row, seconds=0.0) for row in alone]
    assert len(seen) == len(rows) == 8


def test_a_sweep_in_workers_with_a_registry_of_its_own_is_refused() -> None:
    with pytest.raises(ValueError, match="pass registry=None, or jobs=1 to use this registry"):
        sweep([[b"a"]], [1], registry=ConnectorRegistry(), jobs=2)
    with pytest.raises(ValueError, match=r"jobs is the number of worker processes, >= 1; got 0"):
        sweep([[b"a"]], [1], jobs=0)
