"""The scheduler-side planning the CPU-offload and store connectors share."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvwire.connector.types import (
    BlockHash,
    KVCacheBlocks,
    Request,
    ScheduledRequest,
    SchedulerOutput,
)
from kvwire.connectors.block_planner import BlockPlanner, BlockRange

BLOCK = 4
HASHES = [bytes([n]) * 8 for n in range(4)]
BLOCK_IDS = [30, 31, 32, 33, 34]


def request_of(request_id: str = "r", num_tokens: int = 17) -> Request:
    """A prompt of four full blocks and one token more."""
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(num_tokens)),
        max_tokens=1,
        block_hashes=list(HASHES),
    )


def medium_holding(*held: BlockHash):
    def count_hits(block_hashes: Sequence[BlockHash]) -> int:
        hits = 0
        for block_hash in block_hashes:
            if block_hash not in held:
                break
            hits += 1
        return hits

    return count_hits


def step(request_id: str, num_computed_tokens: int, num_scheduled_tokens: int) -> SchedulerOutput:
    item = ScheduledRequest(
        request_id=request_id,
        block_ids=(list(BLOCK_IDS),),
        num_computed_tokens=num_computed_tokens,
        num_scheduled_tokens=num_scheduled_tokens,
        is_new=num_computed_tokens == 0,
    )
    return SchedulerOutput(scheduled=[item])


def planner(*, loads: bool = True, saves: bool = True) -> BlockPlanner:
    return BlockPlanner(BLOCK, loads=loads, saves=saves)


def test_lookup_counts_only_the_consecutive_prefix_the_medium_holds():
    assert planner().look_up(request_of(), 0, medium_holding(HASHES[0], HASHES[1], HASHES[3])) == 2


def test_lookup_starts_after_the_locally_computed_blocks():
    looked_at: list[Sequence[BlockHash]] = []

    def count_hits(block_hashes: Sequence[BlockHash]) -> int:
        looked_at.append(list(block_hashes))
        return 0

    planner().look_up(request_of(), 2 * BLOCK, count_hits)
    assert looked_at == [HASHES[2:]]


def test_lookup_leaves_the_last_prompt_token_to_compute():
    # 16 tokens: the fourth block holds the last token, which the engine computes.
    assert planner().look_up(request_of(num_tokens=16), 0, medium_holding(*HASHES)) == 3


def test_a_planner_that_does_not_load_finds_no_hits():
    assert planner(loads=False).look_up(request_of(), 0, medium_holding(*HASHES)) == 0


def test_allocation_returns_the_found_blocks_to_load():
    plan = planner()
    plan.look_up(request_of(), BLOCK, medium_holding(*HASHES))
    load = plan.allocate(request_of(), KVCacheBlocks((list(BLOCK_IDS),)), 2 * BLOCK)
    assert load == BlockRange("r", tuple(BLOCK_IDS[1:3]), tuple(HASHES[1:3]))


def test_allocation_without_external_tokens_loads_nothing():
    plan = planner()
    plan.look_up(request_of(), 0, medium_holding(*HASHES))
    assert plan.allocate(request_of(), KVCacheBlocks((list(BLOCK_IDS),)), 0) is None


def test_allocation_asking_for_more_than_the_lookup_found_is_refused():
    plan = planner()
    plan.look_up(request_of(), 0, medium_holding(HASHES[0]))
    with pytest.raises(
        ValueError,
        match=r"^update_state_after_alloc: request 'r' asks for 8 external tokens, "
        r"the lookup found 4$",
    ):
        plan.allocate(request_of(), KVCacheBlocks((list(BLOCK_IDS),)), 2 * BLOCK)


def test_lookup_counts_add_up_over_allocated_requests_and_reset_when_taken():
    plan = planner()
    for request_id in ("a", "b"):
        plan.look_up(request_of(request_id), 0, medium_holding(HASHES[0]))
        plan.allocate(request_of(request_id), KVCacheBlocks((list(BLOCK_IDS),)), 0)
    assert plan.take_lookup_counts() == (2, 6)
    assert plan.take_lookup_counts() == (0, 0)


def test_saves_cover_each_full_block_once_as_steps_compute_them():
    plan = planner()
    plan.allocate(request_of(), KVCacheBlocks((list(BLOCK_IDS),)), 0)
    first = plan.plan_saves(step("r", 0, 10))
    second = plan.plan_saves(step("r", 10, 7))
    assert first == [BlockRange("r", tuple(BLOCK_IDS[:2]), tuple(HASHES[:2]), tuple(BLOCK_IDS[:2]))]
    # A save's context: every block of the request up to its last saved one.
    assert second == [
        BlockRange("r", tuple(BLOCK_IDS[2:4]), tuple(HASHES[2:4]), tuple(BLOCK_IDS[:4]))
    ]
    assert plan.plan_saves(step("r", 17, 1)) == []


def test_saves_skip_the_blocks_found_at_lookup():
    plan = planner()
    plan.look_up(request_of(), 0, medium_holding(HASHES[0], HASHES[1]))
    plan.allocate(request_of(), KVCacheBlocks((list(BLOCK_IDS),)), 2 * BLOCK)
    saves = plan.plan_saves(step("r", 2 * BLOCK, 9))
    assert saves == [
        BlockRange("r", tuple(BLOCK_IDS[2:4]), tuple(HASHES[2:4]), tuple(BLOCK_IDS[:4]))
    ]


def test_a_planner_that_does_not_save_plans_no_saves():
    plan = planner(saves=False)
    plan.allocate(request_of(), KVCacheBlocks((list(BLOCK_IDS),)), 0)
    assert plan.plan_saves(step("r", 0, 17)) == []


def test_a_forgotten_request_is_no_longer_saved():
    plan = planner()
    plan.allocate(request_of(), KVCacheBlocks((list(BLOCK_IDS),)), 0)
    plan.forget("r")
    assert plan.plan_saves(step("r", 0, 17)) == []


def test_blocks_whose_load_failed_are_saved_again_once_recomputed():
    plans = planner()
    request = request_of()
    plans.look_up(request, 0, medium_holding(*HASHES[:3]))
    loaded = plans.allocate(request, KVCacheBlocks((list(BLOCK_IDS),)), 3 * BLOCK)
    assert loaded is not None and loaded.block_ids == (30, 31, 32)
    # The load step computes the rest: only the block after the loaded ones is new.
    assert [r.block_hashes for r in plans.plan_saves(step("r", 3 * BLOCK, 5))] == [(HASHES[3],)]

    plans.loads_failed({31, 99})  # block 31 holds the second block; 99 is another request's

    # The engine computes again from the second block: it and the ones after are saved.
    again = plans.plan_saves(step("r", 1 * BLOCK, 13))
    assert [(r.block_ids, r.block_hashes) for r in again] == [((31, 32, 33), tuple(HASHES[1:]))]


def test_failed_loads_of_other_requests_blocks_change_no_plan():
    plans = planner()
    request = request_of()
    plans.look_up(request, 0, medium_holding(*HASHES[:2]))
    plans.allocate(request, KVCacheBlocks((list(BLOCK_IDS),)), 2 * BLOCK)
    plans.loads_failed({40, 41})  # not this request's blocks

    saved = plans.plan_saves(step("r", 2 * BLOCK, 9))
    assert [r.block_hashes for r in saved] == [tuple(HASHES[2:])]
