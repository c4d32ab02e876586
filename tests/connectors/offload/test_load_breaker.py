"""A medium whose loads keep failing has its hits withheld for a while, then one load probes it."""

from __future__ import annotations

import logging
from collections import Counter

import pytest

from kvwire.connectors.offload._load_breaker import LoadBreaker
from kvwire.connectors.offload.scheduler import OffloadSchedulerHalf
from kvwire.interface.types import KVCacheBlocks, KVConnectorOutput, SchedulerOutput
from tests.connectors.offload.test_block_planner import (
    BLOCK,
    BLOCK_IDS,
    planner,
    request_of,
)
from tests.support.media import IndexHoldingEverything


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def breaker(clock: Clock, failures_to_pause: int = 3, pause_s: float = 10.0) -> LoadBreaker:
    return LoadBreaker(
        "medium 'test'", failures_to_pause=failures_to_pause, pause_s=pause_s, clock=clock
    )


def fail(load_breaker: LoadBreaker, times: int) -> None:
    for _ in range(times):
        load_breaker.load_started()
        load_breaker.load_ended(failed=True)


def test_hits_are_offered_until_loads_fail_that_many_times_in_a_row():
    load_breaker = breaker(Clock())
    fail(load_breaker, 2)
    assert load_breaker.offers_hits()
    fail(load_breaker, 1)
    assert not load_breaker.offers_hits()
    assert load_breaker.take_counters() == {
        "loads_failed": 3,
        "load_pauses": 1,
        "lookups_paused": 1,
    }
    assert load_breaker.take_counters() == {
        "loads_failed": 0,
        "load_pauses": 0,
        "lookups_paused": 0,
    }


def test_a_sound_load_between_failed_ones_starts_the_count_again():
    load_breaker = breaker(Clock())
    fail(load_breaker, 2)
    load_breaker.load_ended(failed=False)
    fail(load_breaker, 2)
    assert load_breaker.offers_hits()


def test_once_the_pause_is_over_one_load_probes_and_the_lookups_miss_while_it_runs():
    clock = Clock()
    load_breaker = breaker(clock)
    fail(load_breaker, 3)
    clock.now += 9.9
    assert not load_breaker.offers_hits()
    clock.now += 0.1
    assert load_breaker.offers_hits()  # the probe's lookup
    assert load_breaker.offers_hits()  # asked again before its load is planned: no side effect
    load_breaker.load_started()
    assert not load_breaker.offers_hits()
    load_breaker.load_ended(failed=False)
    assert load_breaker.offers_hits()
    assert not load_breaker.paused


def test_a_failed_probe_withholds_the_hits_for_another_pause():
    clock = Clock()
    load_breaker = breaker(clock)
    fail(load_breaker, 3)
    clock.now += 10
    assert load_breaker.offers_hits()
    fail(load_breaker, 1)
    assert not load_breaker.offers_hits()
    clock.now += 9.9
    assert not load_breaker.offers_hits()
    clock.now += 0.1
    assert load_breaker.offers_hits()
    assert load_breaker.take_counters()["load_pauses"] == 2


def test_a_probe_whose_end_is_never_reported_lets_another_probe_through_a_pause_later():
    clock = Clock()
    load_breaker = breaker(clock)
    fail(load_breaker, 3)
    clock.now += 10
    load_breaker.load_started()  # its request is, say, aborted and its load never reported
    clock.now += 9.9
    assert not load_breaker.offers_hits()
    clock.now += 0.1
    assert load_breaker.offers_hits()


def test_loads_that_fail_during_a_pause_do_not_extend_it():
    clock = Clock()
    load_breaker = breaker(clock)
    fail(load_breaker, 3)
    clock.now += 5
    load_breaker.load_ended(failed=True)  # a load planned before the pause
    clock.now += 5
    assert load_breaker.offers_hits()


def test_pausing_is_warned_about_at_most_once_per_interval(caplog: pytest.LogCaptureFixture):
    clock = Clock()
    load_breaker = breaker(clock, failures_to_pause=1, pause_s=1)
    with caplog.at_level(logging.WARNING, "kvwire.connectors.offload._load_breaker"):
        for _ in range(5):
            fail(load_breaker, 1)
            clock.now += 1
            assert load_breaker.offers_hits()
    paused = [r.getMessage() for r in caplog.records if "in a row failed" in r.getMessage()]
    assert paused == [
        "medium 'test': 1 loads in a row failed; its hits are not offered for 1s, then one "
        "load probes it (computing is cheaper than loads that fail)"
    ]


@pytest.mark.parametrize(("failures", "pause_s"), [(0, 10.0), (3, 0.0)])
def test_a_breaker_that_would_never_offer_or_never_pause_is_refused(failures, pause_s):
    with pytest.raises(ValueError, match=r"^LoadBreaker: failures_to_pause must be >= 1"):
        LoadBreaker("m", failures_to_pause=failures, pause_s=pause_s)


# ------------------------------------------------------------ the scheduler half


def test_the_scheduler_answers_miss_without_asking_the_medium_while_its_loads_keep_failing():
    clock = Clock()
    index = IndexHoldingEverything()
    scheduler = OffloadSchedulerHalf(
        index=index,
        planner=planner(),
        num_groups=1,
        async_load=True,
        load_breaker=breaker(clock, failures_to_pause=2),
    )
    counters: Counter[str] = Counter()
    for request_id in ("a", "b"):
        request = request_of(request_id)
        assert scheduler.get_num_new_matched_tokens(request, 0) == (4 * BLOCK, True)
        scheduler.update_state_after_alloc(request, KVCacheBlocks((list(BLOCK_IDS),)), 4 * BLOCK)
        counters.update(dict(scheduler.build_connector_meta(SchedulerOutput()).counters))
        scheduler.update_connector_output(
            KVConnectorOutput(finished_recving={request_id}, invalid_block_ids={31})
        )
    asked = index.lookups
    assert scheduler.get_num_new_matched_tokens(request_of("c"), 0) == (0, False)
    assert index.lookups == asked
    counters.update(dict(scheduler.build_connector_meta(SchedulerOutput()).counters))
    assert counters["loads_failed"] == 2
    assert counters["load_pauses"] == 1
    assert counters["lookups_paused"] == 1
    clock.now += 10
    assert scheduler.get_num_new_matched_tokens(request_of("c"), 0) == (4 * BLOCK, True)


def test_a_request_s_load_over_several_groups_counts_as_one_load():
    from tests.connectors.offload.test_block_planner import (
        FULL_IDS,
        LONG_HASHES,
        SLIDING_IDS,
        hybrid_planner,
        long_request,
    )

    clock = Clock()
    load_breaker = breaker(clock, failures_to_pause=2)
    scheduler = OffloadSchedulerHalf(
        index=IndexHoldingEverything(),
        planner=hybrid_planner(),
        num_groups=2,
        async_load=False,
        load_breaker=load_breaker,
    )
    request = long_request()
    assert scheduler.get_num_new_matched_tokens(request, 0)[0] == len(LONG_HASHES) * BLOCK
    blocks = KVCacheBlocks((FULL_IDS, SLIDING_IDS))
    scheduler.update_state_after_alloc(request, blocks, len(LONG_HASHES) * BLOCK)
    assert len(scheduler.build_connector_meta(SchedulerOutput()).loads) == 2
    scheduler.update_connector_output(
        KVConnectorOutput(invalid_block_ids={FULL_IDS[0], SLIDING_IDS[5]})
    )
    assert load_breaker.take_counters()["loads_failed"] == 1


def test_a_load_planned_before_the_pause_that_ends_sound_ends_it():
    clock = Clock()
    load_breaker = breaker(clock)
    fail(load_breaker, 3)
    load_breaker.load_ended(failed=False)
    assert load_breaker.offers_hits()
