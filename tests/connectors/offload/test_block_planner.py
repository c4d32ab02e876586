"""The scheduler-side planning the CPU-offload and store connectors share."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvwire.blocks.groups import CacheGroup
from kvwire.blocks.transfers import BlockTransfer
from kvwire.connectors.offload._planner import BlockPlanner, HitCounter
from kvwire.interface.types import (
    BlockHash,
    KVCacheBlocks,
    Request,
    ScheduledRequest,
    SchedulerOutput,
)

BLOCK = 4
FULL = CacheGroup(0, ("layers.0",), BLOCK)
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


def medium_holding(*held: BlockHash) -> HitCounter:
    """A medium holding ``held`` in every group."""

    def count_hits(group: int, block_hashes: Sequence[BlockHash]) -> int:
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
    return BlockPlanner(BLOCK, (FULL,), loads=loads, saves=saves)


def test_lookup_counts_only_the_consecutive_prefix_the_medium_holds():
    assert planner().look_up(request_of(), 0, medium_holding(HASHES[0], HASHES[1], HASHES[3])) == 2


def test_lookup_starts_after_the_locally_computed_blocks():
    looked_at: list[Sequence[BlockHash]] = []

    def count_hits(group: int, block_hashes: Sequence[BlockHash]) -> int:
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
    loads = plan.allocate(request_of(), KVCacheBlocks((list(BLOCK_IDS),)), 2 * BLOCK)
    assert loads == [
        BlockTransfer(
            request_id="r", block_ids=tuple(BLOCK_IDS[1:3]), block_hashes=tuple(HASHES[1:3])
        )
    ]


def test_allocation_without_external_tokens_loads_nothing():
    plan = planner()
    plan.look_up(request_of(), 0, medium_holding(*HASHES))
    assert plan.allocate(request_of(), KVCacheBlocks((list(BLOCK_IDS),)), 0) == []


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
    assert plan.take_lookup_counts() == (2, 6, 0)
    assert plan.take_lookup_counts() == (0, 0, 0)


def test_saves_cover_each_full_block_once_as_steps_compute_them():
    plan = planner()
    plan.allocate(request_of(), KVCacheBlocks((list(BLOCK_IDS),)), 0)
    first = plan.plan_saves(step("r", 0, 10))
    second = plan.plan_saves(step("r", 10, 7))
    assert first == [
        BlockTransfer(
            request_id="r",
            block_ids=tuple(BLOCK_IDS[:2]),
            block_hashes=tuple(HASHES[:2]),
            context_block_ids=tuple(BLOCK_IDS[:2]),
        )
    ]
    # A save's context: every block of the request up to its last saved one.
    assert second == [
        BlockTransfer(
            request_id="r",
            block_ids=tuple(BLOCK_IDS[2:4]),
            block_hashes=tuple(HASHES[2:4]),
            context_block_ids=tuple(BLOCK_IDS[:4]),
        )
    ]
    assert plan.plan_saves(step("r", 17, 1)) == []


def test_saves_skip_the_blocks_found_at_lookup():
    plan = planner()
    plan.look_up(request_of(), 0, medium_holding(HASHES[0], HASHES[1]))
    plan.allocate(request_of(), KVCacheBlocks((list(BLOCK_IDS),)), 2 * BLOCK)
    saves = plan.plan_saves(step("r", 2 * BLOCK, 9))
    assert saves == [
        BlockTransfer(
            request_id="r",
            block_ids=tuple(BLOCK_IDS[2:4]),
            block_hashes=tuple(HASHES[2:4]),
            context_block_ids=tuple(BLOCK_IDS[:4]),
        )
    ]


def test_blocks_another_connector_loaded_asynchronously_are_saved():
    # vLLM's MultiConnector: another connector's lookup found the prompt and loads it
    # asynchronously; this planner is allocated with no external tokens, then again
    # once the load ended, with the request's computed tokens past the loaded blocks.
    plan = planner()
    request = request_of()
    plan.look_up(request, 0, medium_holding())
    plan.allocate(request, KVCacheBlocks((list(BLOCK_IDS),)), 0)
    request.num_computed_tokens = 4 * BLOCK
    plan.allocate(request, KVCacheBlocks((list(BLOCK_IDS),)), 0)
    saves = plan.plan_saves(step("r", 4 * BLOCK, 1))
    assert [(s.block_ids, s.block_hashes) for s in saves] == [(tuple(BLOCK_IDS[:4]), tuple(HASHES))]


def test_blocks_this_medium_loaded_asynchronously_are_not_saved_again():
    plan = planner()
    request = request_of()
    plan.look_up(request, 0, medium_holding(*HASHES[:3]))
    plan.allocate(request, KVCacheBlocks((list(BLOCK_IDS),)), 3 * BLOCK)
    request.num_computed_tokens = 3 * BLOCK
    plan.allocate(request, KVCacheBlocks((list(BLOCK_IDS),)), 0)
    saves = plan.plan_saves(step("r", 3 * BLOCK, 5))
    assert [(s.block_ids, s.block_hashes) for s in saves] == [((BLOCK_IDS[3],), (HASHES[3],))]


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
    assert [load.block_ids for load in loaded] == [(30, 31, 32)]
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


# ------------------------------------------------------------ hybrid models

# A full-attention group and a sliding-window group. A window of 9 tokens
# reaches ceil(8 / 4) = 2 blocks back: a prefix of n blocks needs blocks
# [n - 2, n) of the sliding group, and all n of the full group.
SLIDING = CacheGroup(1, ("layers.1",), BLOCK, sliding_window=9)
LONG_HASHES = [bytes([n]) * 8 for n in range(6)]
FULL_IDS = [10, 11, 12, 13, 14, 15, 16]
SLIDING_IDS = [20, 21, 22, 23, 24, 25, 26]


def hybrid_planner(*, loads: bool = True, saves: bool = True) -> BlockPlanner:
    return BlockPlanner(BLOCK, (FULL, SLIDING), loads=loads, saves=saves)


def long_request(request_id: str = "r") -> Request:
    """Six full blocks and one token more."""
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(25)),
        max_tokens=1,
        block_hashes=list(LONG_HASHES),
    )


def hybrid_step(
    num_computed_tokens: int, num_scheduled_tokens: int, sliding_ids: Sequence[int] = SLIDING_IDS
) -> SchedulerOutput:
    item = ScheduledRequest(
        request_id="r",
        block_ids=(list(FULL_IDS), list(sliding_ids)),
        num_computed_tokens=num_computed_tokens,
        num_scheduled_tokens=num_scheduled_tokens,
        is_new=num_computed_tokens == 0,
    )
    return SchedulerOutput(scheduled=[item])


def step_of(
    request_id: str, num_computed_tokens: int, num_scheduled_tokens: int
) -> SchedulerOutput:
    item = ScheduledRequest(
        request_id=request_id,
        block_ids=(list(FULL_IDS), list(SLIDING_IDS)),
        num_computed_tokens=num_computed_tokens,
        num_scheduled_tokens=num_scheduled_tokens,
        is_new=True,
    )
    return SchedulerOutput(scheduled=[item])


def groups_holding(full: Sequence[BlockHash], sliding: Sequence[BlockHash]) -> HitCounter:
    held = {FULL.index: set(full), SLIDING.index: set(sliding)}

    def count_hits(group: int, block_hashes: Sequence[BlockHash]) -> int:
        hits = 0
        for block_hash in block_hashes:
            if block_hash not in held[group]:
                break
            hits += 1
        return hits

    return count_hits


def test_a_sliding_group_saves_only_the_window_at_a_prefix_end_inside_a_block():
    plan = hybrid_planner()
    plan.allocate(long_request(), KVCacheBlocks((FULL_IDS, SLIDING_IDS)), 0)
    saves = plan.plan_saves(hybrid_step(0, 25))
    by_group = {save.group: save.block_ids for save in saves}
    # 25 tokens: the window at the end is blocks 4-5. The prefix does not end
    # on a block boundary, so a prompt equal to it hits at block 6 too: blocks
    # 0-3 are never read again.
    assert by_group == {0: tuple(FULL_IDS[:6]), 1: (24, 25)}
    assert [save.block_hashes for save in saves if save.group == 1] == [tuple(LONG_HASHES[4:6])]


@pytest.mark.parametrize(
    ("tokens_after_step", "sliding_saved"),
    [(24, (23, 24, 25)), (25, (24, 25)), (27, (24, 25))],
    ids=["aligned", "one-token-past", "three-tokens-past"],
)
def test_a_sliding_group_saves_the_block_before_the_window_only_when_the_step_ends_a_block(
    tokens_after_step: int, sliding_saved: tuple[int, ...]
) -> None:
    # Every step ends at block 6 (window 4-5). Only a prefix of exactly 24
    # tokens is a prompt that hits a block earlier (its last token is
    # recomputed), at block 5, whose window reaches block 3.
    plan = hybrid_planner()
    request = Request(
        request_id="r",
        prompt_token_ids=list(range(28)),
        max_tokens=1,
        block_hashes=list(LONG_HASHES),
    )
    plan.allocate(request, KVCacheBlocks((FULL_IDS, SLIDING_IDS)), 0)
    saves = plan.plan_saves(hybrid_step(0, tokens_after_step))
    assert [(save.group, save.block_ids) for save in saves] == [
        (0, tuple(FULL_IDS[:6])),
        (1, sliding_saved),
    ]


def test_a_sliding_group_skips_the_blocks_that_left_the_window_between_steps():
    plan = hybrid_planner()
    plan.allocate(long_request(), KVCacheBlocks((FULL_IDS, SLIDING_IDS)), 0)
    first = plan.plan_saves(hybrid_step(0, 8))
    # Blocks 2 and 3 are computed by the second step, whose prefix ends at
    # block 6, inside block 7 (25 tokens): neither is in the window there
    # (4-5), so neither is ever read again.
    second = plan.plan_saves(hybrid_step(8, 17))
    assert [(save.group, save.block_ids) for save in first] == [(0, (10, 11)), (1, (20, 21))]
    assert [(save.group, save.block_ids) for save in second] == [
        (0, (12, 13, 14, 15)),
        (1, (24, 25)),
    ]


class RecordingMedium:
    """What a medium holds per group, filled by the planned saves; records the questions asked."""

    def __init__(self) -> None:
        self.held: dict[int, set[BlockHash]] = {FULL.index: set(), SLIDING.index: set()}
        self.questions: list[tuple[int, list[BlockHash]]] = []

    def count_hits(self, group: int, block_hashes: Sequence[BlockHash]) -> int:
        self.questions.append((group, list(block_hashes)))
        hits = 0
        for block_hash in block_hashes:
            if block_hash not in self.held[group]:
                break
            hits += 1
        return hits

    def store(self, saves: Sequence[BlockTransfer]) -> dict[int, tuple[BlockHash, ...]]:
        """Hold ``saves``; what each group saved."""
        for save in saves:
            self.held[save.group].update(save.block_hashes)
        return {save.group: save.block_hashes for save in saves}


def branching_request(request_id: str, tail: int) -> Request:
    """Request r's first three blocks and a tail of 6 tokens, shorter than the 9-token window."""
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(18)),
        max_tokens=1,
        block_hashes=[*LONG_HASHES[:3], bytes([tail]) * 8],
    )


def test_a_request_branching_off_a_local_hit_saves_the_window_at_its_branch_point_once():
    plan = hybrid_planner()
    medium = RecordingMedium()
    plan.look_up(long_request(), 0, medium.count_hits)
    plan.allocate(long_request(), KVCacheBlocks((FULL_IDS, SLIDING_IDS)), 0)
    # r saves its window at block 6 (25 tokens): blocks 4-5.
    assert medium.store(plan.plan_saves(hybrid_step(0, 25)))[SLIDING.index] == tuple(
        LONG_HASHES[4:6]
    )
    plan.forget("r")

    # b shares r's first 3 blocks through the engine's own cache and computes
    # a tail shorter than the window: its step's window (2-3) holds only one
    # of its blocks. The window at its branch point (1-2), which the medium
    # lacks, is saved too, so a later prompt ending there, or equal to b's
    # prefix, finds its window.
    b = branching_request("b", 20)
    assert plan.look_up(b, 3 * BLOCK, medium.count_hits) == 0
    plan.allocate(b, KVCacheBlocks((FULL_IDS, SLIDING_IDS)), 0)
    saved = medium.store(plan.plan_saves(step_of("b", 3 * BLOCK, 6)))
    assert saved == {FULL.index: (b.block_hashes[3],), SLIDING.index: tuple(b.block_hashes[1:4])}
    plan.forget("b")
    assert plan.look_up(branching_request("b2", 20), 0, medium.count_hits) == 4
    assert plan.look_up(branching_request("b3", 21), 0, medium.count_hits) == 3

    # c branches at the same point: the medium holds that window now, which
    # one question per sliding group (last block first) tells; c saves only
    # its own block.
    c = branching_request("c", 22)
    medium.questions.clear()
    assert plan.look_up(c, 3 * BLOCK, medium.count_hits) == 0
    assert (SLIDING.index, [LONG_HASHES[2], LONG_HASHES[1]]) in medium.questions
    assert [group for group, _ in medium.questions].count(SLIDING.index) == 1
    plan.allocate(c, KVCacheBlocks((FULL_IDS, SLIDING_IDS)), 0)
    saved = medium.store(plan.plan_saves(step_of("c", 3 * BLOCK, 6)))
    assert saved == {FULL.index: (c.block_hashes[3],), SLIDING.index: (c.block_hashes[3],)}


@pytest.mark.parametrize("first_step_tokens", [None, BLOCK + 1], ids=["one-step", "chunked"])
@pytest.mark.parametrize("num_blocks", [5, 6])
@pytest.mark.parametrize("sliding_window", [5, 9, 13])
def test_a_prompt_equal_to_a_saved_block_aligned_one_hits_all_but_its_last_block_in_every_group(
    sliding_window: int, num_blocks: int, first_step_tokens: int | None
) -> None:
    # The engine recomputes a prompt's last token, so the hit of a prompt of
    # exactly n blocks ends at block n - 1: the sliding group must hold the
    # window ending there, one block earlier than the saved prefix's end.
    sliding = CacheGroup(SLIDING.index, SLIDING.layer_names, BLOCK, sliding_window=sliding_window)
    plan = BlockPlanner(BLOCK, (FULL, sliding), loads=True, saves=True)
    num_tokens = num_blocks * BLOCK

    def aligned(request_id: str) -> Request:
        return Request(
            request_id=request_id,
            prompt_token_ids=list(range(num_tokens)),
            max_tokens=1,
            block_hashes=list(LONG_HASHES[:num_blocks]),
        )

    plan.allocate(aligned("a"), KVCacheBlocks((FULL_IDS, SLIDING_IDS)), 0)
    saved: dict[int, set[BlockHash]] = {FULL.index: set(), sliding.index: set()}
    # In one step, or chunked: a block and a token, then the rest.
    steps = [num_tokens] if first_step_tokens is None else [first_step_tokens, num_tokens]
    computed = 0
    for step_end in steps:
        item = ScheduledRequest(
            request_id="a",
            block_ids=(FULL_IDS, SLIDING_IDS),
            num_computed_tokens=computed,
            num_scheduled_tokens=step_end - computed,
            is_new=computed == 0,
        )
        for save in plan.plan_saves(SchedulerOutput(scheduled=[item])):
            saved[save.group].update(save.block_hashes)
        computed = step_end

    b = aligned("b")
    assert plan.look_up(b, 0, groups_holding(saved[FULL.index], saved[sliding.index])) == (
        num_blocks - 1
    )
    loads = plan.allocate(b, KVCacheBlocks((FULL_IDS, SLIDING_IDS)), (num_blocks - 1) * BLOCK)
    assert {load.group: load.block_hashes for load in loads} == {
        FULL.index: tuple(LONG_HASHES[: num_blocks - 1]),
        sliding.index: tuple(
            LONG_HASHES[sliding.needed_positions(num_blocks - 1).start : num_blocks - 1]
        ),
    }


def test_null_blocks_of_a_sliding_group_are_never_saved_or_loaded():
    plan = hybrid_planner()
    request = long_request()
    sliding_ids = [0, 0, 0, 0, 24, 25, 26]
    plan.look_up(request, 0, groups_holding(LONG_HASHES, LONG_HASHES))
    loads = plan.allocate(request, KVCacheBlocks((FULL_IDS, sliding_ids)), 6 * BLOCK)
    assert [(load.group, load.block_ids) for load in loads] == [
        (0, tuple(FULL_IDS[:6])),
        (1, (24, 25)),
    ]
    plan2 = hybrid_planner()
    plan2.allocate(request, KVCacheBlocks((FULL_IDS, sliding_ids)), 0)
    # A window of 12 blocks back would reach the null ones: still never moved.
    saves = plan2.plan_saves(hybrid_step(0, 25, sliding_ids))
    assert all(0 not in save.block_ids for save in saves)
    assert all(0 not in save.context_block_ids for save in saves)


def test_the_hit_needs_only_the_window_of_a_sliding_group():
    # The sliding group holds just the last two blocks: enough for all six.
    counter = groups_holding(LONG_HASHES, LONG_HASHES[4:])
    assert hybrid_planner().look_up(long_request(), 0, counter) == 6


def test_a_gap_in_the_sliding_window_moves_the_hit_back_before_it():
    # Block 4 is missing in the sliding group: a prefix of 5 or 6 blocks has
    # it in its window; a prefix of 4 needs blocks 2 and 3, which are held.
    counter = groups_holding(LONG_HASHES, [h for h in LONG_HASHES if h != LONG_HASHES[4]])
    assert hybrid_planner().look_up(long_request(), 0, counter) == 4


def test_the_hit_is_the_longest_prefix_valid_in_every_group():
    # The full group lacks block 3: at most 3 blocks, whose window (blocks 1
    # and 2) the sliding group must hold too; it lacks block 2, so 2 blocks.
    counter = groups_holding(
        [h for h in LONG_HASHES if h != LONG_HASHES[3]],
        [h for h in LONG_HASHES if h != LONG_HASHES[2]],
    )
    assert hybrid_planner().look_up(long_request(), 0, counter) == 2


def test_a_hit_loads_every_block_of_the_full_group_and_the_window_of_the_sliding_one():
    plan = hybrid_planner()
    request = long_request()
    assert plan.look_up(request, BLOCK, groups_holding(LONG_HASHES, LONG_HASHES)) == 5
    loads = plan.allocate(request, KVCacheBlocks((FULL_IDS, SLIDING_IDS)), 5 * BLOCK)
    assert [(load.group, load.block_ids, load.block_hashes) for load in loads] == [
        (0, tuple(FULL_IDS[1:6]), tuple(LONG_HASHES[1:6])),
        (1, (24, 25), tuple(LONG_HASHES[4:6])),
    ]


def test_block_ids_for_another_number_of_groups_are_refused():
    plan = hybrid_planner()
    with pytest.raises(
        ValueError,
        match=r"^request 'r': got block ids for 1 KV cache groups, the kv_cache_config has 2$",
    ):
        plan.allocate(long_request(), KVCacheBlocks((FULL_IDS,)), 0)


def test_a_failed_load_in_a_sliding_group_saves_both_groups_again_from_that_block():
    plan = hybrid_planner()
    request = long_request()
    plan.look_up(request, 0, groups_holding(LONG_HASHES, LONG_HASHES))
    plan.allocate(request, KVCacheBlocks((FULL_IDS, SLIDING_IDS)), 6 * BLOCK)
    plan.loads_failed({24})  # the sliding group's block 4
    again = plan.plan_saves(hybrid_step(4 * BLOCK, 9))
    assert [(save.group, save.block_ids) for save in again] == [(0, (14, 15)), (1, (24, 25))]


# ----------------------------------------------------- blocks about to be written


ONE_BLOCK_WINDOW = CacheGroup(1, ("layers.1",), BLOCK, sliding_window=5)


def _scheduled(request_id: str, block_ids: tuple[list[int], ...], computed: int, new: int):
    item = ScheduledRequest(
        request_id=request_id,
        block_ids=block_ids,
        num_computed_tokens=computed,
        num_scheduled_tokens=new,
        is_new=computed == 0,
    )
    return SchedulerOutput(scheduled=[item])


def test_new_block_ids_are_those_given_to_a_request_beyond_its_local_hit():
    plan = planner()
    request = request_of()
    plan.look_up(request, 2 * BLOCK, medium_holding())
    plan.allocate(request, KVCacheBlocks((list(BLOCK_IDS),)), 0)
    # The two blocks of the local hit are shared and only read.
    assert plan.take_new_block_ids() == {32, 33, 34}
    assert plan.take_new_block_ids() == set()


def test_new_block_ids_follow_each_step_growth_and_a_sliding_groups_reallocation():
    plan = BlockPlanner(BLOCK, (FULL, ONE_BLOCK_WINDOW), loads=True, saves=True)
    request = request_of(num_tokens=13)
    plan.look_up(request, 0, medium_holding())
    plan.allocate(request, KVCacheBlocks(([1, 2, 3], [4, 5, 6])), 0)
    assert plan.take_new_block_ids() == {1, 2, 3, 4, 5, 6}
    plan.plan_saves(_scheduled("r", ([1, 2, 3], [4, 5, 6]), 0, 12))
    assert plan.take_new_block_ids() == set()
    # Next step: a block more in each group; the sliding window gave back
    # block 4 (null now, never "written"), and a rollback replaced block 5 by 9.
    plan.plan_saves(_scheduled("r", ([1, 2, 3, 7], [0, 9, 6, 8]), 12, 1))
    assert plan.take_new_block_ids() == {7, 8, 9}


def test_new_block_ids_are_not_tracked_when_the_engine_does_not_save():
    plan = planner(saves=False)
    request = request_of()
    plan.look_up(request, 0, medium_holding())
    plan.allocate(request, KVCacheBlocks((list(BLOCK_IDS),)), 0)
    plan.plan_saves(step("r", 0, 17))
    assert plan.take_new_block_ids() == set()


def test_a_model_of_sliding_layers_only_never_saves_the_null_block():
    # One sliding-window group and nothing else: the engine still holds block 0
    # (null) at the positions that left the window, and so does vLLM.
    only_sliding = CacheGroup(0, ("layers.0",), BLOCK, sliding_window=9)
    plan = BlockPlanner(BLOCK, (only_sliding,), loads=True, saves=True)
    request = request_of("r", num_tokens=25)
    request.block_hashes = [bytes([n]) * 8 for n in range(6)]
    # Five blocks are the engine's own; the medium lacks the window ending there.
    plan.look_up(request, 5 * BLOCK, medium_holding())
    plan.allocate(request, KVCacheBlocks(([40, 41, 42, 43, 44, 45],)), 0)

    # By the time the step runs, the engine has nulled what left the window.
    saves = plan.plan_saves(_scheduled("r", ([0, 0, 0, 0, 44, 45],), 20, 5))

    assert [save.block_ids for save in saves] == [(44, 45)]
    assert 0 not in plan.take_new_block_ids()


def test_a_branch_window_is_saved_even_by_a_step_that_completes_no_new_block():
    plan = BlockPlanner(BLOCK, (FULL, ONE_BLOCK_WINDOW), loads=True, saves=True)
    request = request_of("r", num_tokens=14)
    # Three blocks are the engine's own (a local hit); the medium lacks their window.
    plan.look_up(request, 3 * BLOCK, medium_holding())
    plan.allocate(request, KVCacheBlocks(([1, 2, 3, 4], [0, 6, 7, 8])), 0)

    # Tokens 12..13: block 3 is not full, so nothing new is complete.
    saves = plan.plan_saves(_scheduled("r", ([1, 2, 3, 4], [0, 6, 7, 8]), 12, 2))

    assert [(save.group, save.block_ids) for save in saves] == [(1, (7,))]
