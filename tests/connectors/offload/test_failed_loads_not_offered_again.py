"""A block whose load failed, and every block after it, is never offered to that request again.

vLLM looks a request up again as soon as its asynchronous load failed; the
same load would fail the same way (a load slower than its deadline), so the
engine would recompute and ask again without end.
"""

from __future__ import annotations

from kvwire.connectors.offload._planner import BlockPlanner
from kvwire.connectors.offload.scheduler import OffloadSchedulerHalf
from kvwire.interface.types import KVCacheBlocks, KVConnectorOutput, SchedulerOutput
from tests.connectors.offload.test_block_planner import (
    BLOCK,
    BLOCK_IDS,
    FULL,
    FULL_IDS,
    HASHES,
    LONG_HASHES,
    SLIDING_IDS,
    groups_holding,
    hybrid_planner,
    long_request,
    medium_holding,
    planner,
    request_of,
)
from tests.support.media import IndexHoldingEverything


def loaded_then_failed(plan: BlockPlanner, failed: set[int], request_id: str = "r") -> None:
    """Look up and load all four blocks of the request, then report ``failed`` block ids."""
    request = request_of(request_id)
    assert plan.look_up(request, 0, medium_holding(*HASHES)) == 4
    plan.allocate(request, KVCacheBlocks((list(BLOCK_IDS),)), 4 * BLOCK)
    plan.loads_failed(failed)


def test_a_request_whose_load_failed_is_offered_only_the_blocks_before_the_first_failed_one():
    plan = planner()
    loaded_then_failed(plan, {32, 33})  # the third and fourth blocks
    assert plan.look_up(request_of(), 0, medium_holding(*HASHES)) == 2
    # Looked up again after computing locally past it: nothing more to offer.
    assert plan.look_up(request_of(), 3 * BLOCK, medium_holding(*HASHES)) == 0


def test_a_load_failed_at_its_first_block_offers_the_request_nothing_again():
    plan = planner()
    loaded_then_failed(plan, {30})
    assert plan.look_up(request_of(), 0, medium_holding(*HASHES)) == 0


def test_other_requests_are_still_offered_the_blocks_that_failed_to_load():
    plan = planner()
    loaded_then_failed(plan, {30})
    assert plan.look_up(request_of("other"), 0, medium_holding(*HASHES)) == 4


def test_a_finished_request_s_failed_load_is_forgotten():
    plan = planner()
    loaded_then_failed(plan, {30})
    plan.forget("r")
    assert plan.failed_load_start("r") is None
    assert plan.look_up(request_of(), 0, medium_holding(*HASHES)) == 4


def test_a_block_another_connector_failed_to_load_is_not_offered_by_this_one_either():
    # In a composite every child hears of every failed block. A new
    # asynchronous load offered to the request vLLM keeps at the head of its
    # queue can stall vLLM's admission when the KV cache is short.
    plan = planner()
    request = request_of()
    assert plan.look_up(request, BLOCK, medium_holding()) == 0
    plan.allocate(request, KVCacheBlocks((list(BLOCK_IDS),)), 0)
    plan.loads_failed({31, 32})
    assert plan.failed_load_start("r") == 1
    assert plan.look_up(request, BLOCK, medium_holding(*HASHES)) == 0


def test_the_blocks_of_the_local_hit_reported_failed_do_not_count_as_this_planner_s():
    # vLLM's adapter on a hybrid model reports every block of a failed request.
    plan = planner()
    request = request_of()
    plan.look_up(request, BLOCK, medium_holding(*HASHES))
    plan.allocate(request, KVCacheBlocks((list(BLOCK_IDS),)), 3 * BLOCK)
    plan.loads_failed(set(BLOCK_IDS))
    assert plan.failed_load_start("r") == 1


def test_a_second_failed_load_keeps_the_earliest_failed_block():
    plan = planner()
    loaded_then_failed(plan, {32})
    request = request_of()
    assert plan.look_up(request, 0, medium_holding(*HASHES)) == 2
    plan.allocate(request, KVCacheBlocks((list(BLOCK_IDS),)), 2 * BLOCK)
    plan.loads_failed({31})
    assert plan.failed_load_start("r") == 1


def test_the_failed_loads_remembered_are_bounded_the_oldest_forgotten_first():
    plan = BlockPlanner(BLOCK, (FULL,), loads=True, saves=True, max_failed_load_requests=2)
    for request_id in ("a", "b", "c"):
        loaded_then_failed(plan, {30}, request_id)
    assert [plan.failed_load_start(r) for r in ("a", "b", "c")] == [None, 0, 0]


def test_a_failed_sliding_window_block_stops_the_offer_at_that_block_in_every_group():
    plan = hybrid_planner()
    request = long_request()
    everything = groups_holding(LONG_HASHES, LONG_HASHES)
    assert plan.look_up(request, 0, everything) == 6
    plan.allocate(request, KVCacheBlocks((FULL_IDS, SLIDING_IDS)), 6 * BLOCK)
    plan.loads_failed({SLIDING_IDS[4]})
    assert plan.look_up(request, 0, everything) == 4


# ------------------------------------------------------------ the scheduler half


def _scheduler(async_load: bool) -> OffloadSchedulerHalf:
    return OffloadSchedulerHalf(
        index=IndexHoldingEverything(), planner=planner(), num_groups=1, async_load=async_load
    )


def test_an_asynchronous_load_that_failed_is_not_offered_again_to_its_request():
    scheduler = _scheduler(async_load=True)
    request = request_of()
    assert scheduler.get_num_new_matched_tokens(request, 0) == (4 * BLOCK, True)
    scheduler.update_state_after_alloc(request, KVCacheBlocks((list(BLOCK_IDS),)), 4 * BLOCK)
    metadata = scheduler.build_connector_meta(SchedulerOutput())
    assert [load.block_ids for load in metadata.async_loads] == [tuple(BLOCK_IDS[:4])]
    scheduler.update_connector_output(
        KVConnectorOutput(finished_recving={"r"}, invalid_block_ids={30})
    )
    # vLLM frees the request and asks again, as for a new one.
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    assert scheduler.get_num_new_matched_tokens(request_of("other"), 0) == (4 * BLOCK, True)


def test_a_synchronous_load_that_failed_is_offered_up_to_its_failed_block_after_preemption():
    scheduler = _scheduler(async_load=False)
    request = request_of()
    assert scheduler.get_num_new_matched_tokens(request, 0) == (4 * BLOCK, False)
    scheduler.update_state_after_alloc(request, KVCacheBlocks((list(BLOCK_IDS),)), 4 * BLOCK)
    scheduler.build_connector_meta(SchedulerOutput())
    scheduler.update_connector_output(KVConnectorOutput(invalid_block_ids={32}))
    assert scheduler.get_num_new_matched_tokens(request, 0) == (2 * BLOCK, False)
