"""The CPU-offload connector, driven directly over real paged caches."""

from __future__ import annotations

import pytest

from kvwire.config.extra_config import ExtraConfigError
from kvwire.connectors.offload import CPUOffloadConnector, worker
from kvwire.interface.base import KVConnectorRole
from kvwire.interface.types import BlockRemoved, BlockStored, KVCacheBlocks, SchedulerOutput
from tests.support.media import name_another_block, name_another_layout
from tests.support.pairs import (
    ConnectorPair,
    OpenPair,
    PairFactory,
    blocks_equal,
    build_connector,
    cache_config_for,
    engine_config,
    make_request,
)
from tests.support.waits import TEST_LIMIT_S

BLOCK = 4
PROMPT = list(range(100, 117))  # 4 full blocks and one token to compute
FIRST = [3, 7, 1, 9, 12]
SECOND = [20, 21, 22, 23, 24]


@pytest.fixture
def make_pair(open_pair: OpenPair) -> PairFactory:
    def build(kv_role: str = "kv_both", **extra: object) -> ConnectorPair:
        extra.setdefault("cpu_pool_bytes", "4MiB")  # small: tests need a few blocks
        config = engine_config("CPUOffloadConnector", dict(extra), kv_role=kv_role)
        return open_pair(config, CPUOffloadConnector, 1)

    return build


def offload(pair: ConnectorPair, request_id: str = "a", prompt: list[int] = PROMPT) -> None:
    request = make_request(request_id, prompt, BLOCK)
    pair.prefill(request, FIRST)
    pair.finish(request, FIRST)


def test_a_later_request_loads_bit_exact_what_an_earlier_one_offloaded(make_pair):
    pair = make_pair()
    offload(pair)
    for block in SECOND:  # the second request's blocks hold other data
        for cache in pair.caches.values():
            cache[:, block] = 0
    assert pair.prefill(make_request("b", PROMPT, BLOCK), SECOND) == (16, False)
    assert pair.load_errors == set()
    assert blocks_equal(pair.caches, FIRST[:4], pair.caches, SECOND[:4])


def test_stores_complete_asynchronously_and_keep_the_blocks_until_then(make_pair):
    pair = make_pair()
    request = make_request("a", PROMPT, BLOCK)
    pair.prefill(request, FIRST)
    # Not visible before the request finished and the worker reported its stores.
    assert pair.lookup(make_request("b", PROMPT, BLOCK)) == (0, False)
    assert pair.finish(request, FIRST) is True
    assert pair.finished_sending == {"a"}
    assert pair.lookup(make_request("b", PROMPT, BLOCK)) == (16, False)


def test_a_request_that_stored_nothing_frees_its_blocks_at_once(make_pair):
    pair = make_pair(kv_role="kv_consumer")
    request = make_request("a", PROMPT, BLOCK)
    pair.prefill(request, FIRST)
    assert pair.finish(request, FIRST) is False


def test_async_loads_are_reported_through_get_finished(make_pair):
    pair = make_pair(async_load=True)
    offload(pair)
    assert pair.prefill(make_request("b", PROMPT, BLOCK), SECOND) == (16, True)
    pair.step_until(lambda: "b" in pair.finished_recving)
    assert blocks_equal(pair.caches, FIRST[:4], pair.caches, SECOND[:4])


def test_a_step_that_computes_nothing_waits_in_get_finished_for_the_loads_it_holds(
    make_pair, monkeypatch
):
    # An engine whose only request waits for its load would otherwise step
    # again at once, holding the GIL the load threads need.
    monkeypatch.setattr(worker, "IDLE_STEP_WAIT_S", TEST_LIMIT_S)
    pair = make_pair(async_load=True)
    offload(pair)
    plans = []
    build = pair.scheduler.build_connector_meta

    def recorded(output):
        plans.append(build(output))
        return plans[-1]

    monkeypatch.setattr(pair.scheduler, "build_connector_meta", recorded)

    assert pair.prefill(make_request("b", PROMPT, BLOCK), SECOND) == (16, True)

    assert [plan.idle for plan in plans] == [True]
    assert pair.finished_recving == {"b"}  # reported by the step that started it
    assert blocks_equal(pair.caches, FIRST[:4], pair.caches, SECOND[:4])
    pair.prefill(make_request("c", [t + 500 for t in PROMPT], BLOCK), FIRST)
    assert [plan.idle for plan in plans] == [True, False]  # a step that computes


def test_the_pool_evicts_the_least_recently_used_blocks(make_pair):
    probe = make_pair()
    pair = make_pair(cpu_pool_bytes=4 * probe.worker.layout.entry_bytes)
    offload(pair, "a", PROMPT)
    offload(pair, "b", [t + 1000 for t in PROMPT])
    events = list(pair.scheduler.take_events())
    assert pair.lookup(make_request("c", PROMPT, BLOCK)) == (0, False)
    assert pair.lookup(make_request("d", [t + 1000 for t in PROMPT], BLOCK)) == (16, False)
    assert [type(event) for event in events] == [BlockStored, BlockRemoved, BlockStored]
    assert len(events[1].block_hashes) == 4


def test_a_pool_slot_naming_another_block_is_reported_and_never_copied(make_pair):
    pair = make_pair()
    offload(pair)
    name_another_block(pair.worker._worker.handler.pool, 0)  # the first stored block's slot
    for block in SECOND:
        for cache in pair.caches.values():
            cache[:, block] = 0
    pair.prefill(make_request("b", PROMPT, BLOCK), SECOND)
    assert pair.load_errors == {SECOND[0]}
    assert all(not cache[:, SECOND[0]].any() for cache in pair.caches.values())


def test_a_mixed_up_pool_slot_is_forgotten_after_its_failed_load(make_pair):
    pair = make_pair()
    offload(pair)
    name_another_layout(pair.worker._worker.handler.pool, 1)  # the second stored block's slot
    pair.prefill(make_request("b", PROMPT, BLOCK), SECOND)
    assert pair.load_errors == {SECOND[1]}
    assert pair.lookup(make_request("c", PROMPT, BLOCK)) == (BLOCK, False)
    assert any(isinstance(event, BlockRemoved) for event in pair.scheduler.take_events())


def test_stores_the_worker_left_out_are_freed_as_it_reports_them(make_pair):
    # A sibling connector's failed load (a tiered profile) is known to this
    # worker only: the step's invalid_block_ids do not name it here. The
    # scheduler side frees what the worker reports it left out, and nothing
    # it never copied is published.
    pair = make_pair()
    request = make_request("a", PROMPT, BLOCK)
    pair.worker.skip_saves_computed_from({FIRST[0]})
    pair.prefill(request, FIRST)
    assert pair.load_errors == set()
    assert pair.stats["saves_skipped_after_failed_load"] == 4
    assert pair.finish(request, FIRST) is False  # no store left to keep its blocks for
    assert len(pair.scheduler._scheduler.index._index) == 0  # no slot reserved
    assert not any(isinstance(event, BlockStored) for event in pair.scheduler.take_events())
    assert pair.lookup(make_request("b", PROMPT, BLOCK)) == (0, False)


def test_stats_count_saves_loads_and_lookups(make_pair):
    pair = make_pair()
    offload(pair)
    pair.prefill(make_request("b", PROMPT, BLOCK), SECOND)
    pair.step(SchedulerOutput())
    assert pair.stats["blocks_saved"] == 4
    assert pair.stats["blocks_loaded"] == 4
    assert pair.stats["lookup_hit_blocks"] == 4
    assert pair.stats["lookup_miss_blocks"] == 4
    assert pair.stats["bytes_loaded"] == 4 * pair.worker.layout.payload_bytes


def test_reset_cache_forgets_the_pool(make_pair):
    pair = make_pair()
    offload(pair)
    assert pair.scheduler.reset_cache() is True
    assert pair.lookup(make_request("b", PROMPT, BLOCK)) == (0, False)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"cpu_pool_bytes": 100},
            "kv_connector_extra_config.cpu_pool_bytes: 100 bytes hold no block; expected at least",
        ),
        ({"cpu_pool_bytes": "big"}, "kv_connector_extra_config.cpu_pool_bytes: 'big'"),
        ({"async_load": 1}, "kv_connector_extra_config.async_load: 1 is not accepted"),
        ({"pool_size": 5}, "kv_connector_extra_config.pool_size is not an option"),
    ],
)
def test_bad_extra_config_names_the_key_and_what_is_accepted(extra, message):
    config = engine_config("CPUOffloadConnector", extra)
    with pytest.raises(ExtraConfigError) as raised:
        build_connector(
            CPUOffloadConnector, config, KVConnectorRole.SCHEDULER, cache_config_for(config)
        )
    assert message in str(raised.value)


@pytest.mark.parametrize("async_load", [False, True], ids=["sync-load", "async-load"])
def test_transfers_split_across_copy_threads_round_trip(make_pair, async_load):
    pair = make_pair(io_threads=4, async_load=async_load)
    long_prompt = list(range(500, 564))  # 16 full blocks (15 loadable): pieces of 3 or 4
    # 32 cache blocks: two runs of 16 (consecutive ids move as strided copies).
    first, second = list(range(16)), list(range(16, 32))
    request = make_request("a", long_prompt, BLOCK)
    pair.prefill(request, first)
    pair.finish(request, first)
    for block in second:
        for cache in pair.caches.values():
            cache[:, block] = 0
    assert pair.prefill(make_request("b", long_prompt, BLOCK), second) == (60, async_load)
    pair.step_until(lambda: not async_load or "b" in pair.finished_recving)
    assert pair.load_errors == set()
    assert blocks_equal(pair.caches, first[:15], pair.caches, second[:15])


def test_a_request_finished_during_its_async_load_keeps_its_blocks_until_the_load_ends(
    make_pair,
):
    pair = make_pair(async_load=True)
    offload(pair)
    request = make_request("b", PROMPT, BLOCK)
    matched, _ = pair.lookup(request)
    pair.scheduler.update_state_after_alloc(request, KVCacheBlocks((SECOND,)), matched)
    # Aborted before its load ran: the load still writes into its blocks.
    assert pair.scheduler.request_finished(request, SECOND) == (True, None)
    pair.step_until(lambda: "b" in pair.finished_sending)
    # The load's pins are gone: the pool can be emptied.
    assert pair.scheduler.reset_cache() is True


def test_allocating_blocks_the_pool_lost_since_lookup_is_refused(make_pair):
    pair = make_pair()
    offload(pair)
    request = make_request("b", PROMPT, BLOCK)
    assert pair.lookup(request) == (16, False)
    pair.scheduler.reset_cache()
    with pytest.raises(
        ValueError,
        match=r"^update_state_after_alloc: request 'b' asks for 16 external tokens; "
        r"prepare_load: the CPU pool holds 0 of the 4 blocks asked for in KV cache group 0 ",
    ):
        pair.scheduler.update_state_after_alloc(request, KVCacheBlocks((list(SECOND),)), 16)
