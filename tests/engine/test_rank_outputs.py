"""The ranks' reports merged as vLLM's KVOutputAggregator merges them."""

from __future__ import annotations

from kvwire.connector.types import BlockStored, KVConnectorOutput, KVConnectorStats
from kvwire.ranks import RankOutputs

A, B = b"a" * 32, b"b" * 32


def test_a_transfer_is_finished_once_every_rank_reported_it_in_any_step() -> None:
    merged = RankOutputs(world_size=2)
    first = merged.merge(
        [KVConnectorOutput(finished_sending={"r1"}, finished_recving={"r2"}), KVConnectorOutput()]
    )
    assert first is not None
    assert (first.finished_sending, first.finished_recving) == (None, None)
    second = merged.merge(
        [KVConnectorOutput(), KVConnectorOutput(finished_sending={"r1"}, finished_recving={"r2"})]
    )
    assert second is not None
    assert (second.finished_sending, second.finished_recving) == ({"r1"}, {"r2"})


def test_the_connector_s_finished_count_overrides_the_world_size() -> None:
    merged = RankOutputs(world_size=2, finished_count=1).merge(
        [KVConnectorOutput(finished_sending={"r1"}), KVConnectorOutput()]
    )
    assert merged is not None and merged.finished_sending == {"r1"}


def test_failed_blocks_unite_stats_add_and_a_block_is_stored_once_every_rank_stored_it() -> None:
    merged = RankOutputs(world_size=2).merge(
        [
            KVConnectorOutput(
                invalid_block_ids={3},
                kv_connector_stats=KVConnectorStats(data={"blocks_loaded": 2}),
                kv_cache_events=[BlockStored((A, B), "disk", 0)],
            ),
            KVConnectorOutput(
                invalid_block_ids={5},
                kv_connector_stats=KVConnectorStats(data={"blocks_loaded": 3}),
                kv_cache_events=[BlockStored((A,), "disk", 0)],
            ),
        ]
    )
    assert merged is not None
    assert merged.invalid_block_ids == {3, 5}
    assert merged.kv_connector_stats is not None
    assert merged.kv_connector_stats.data == {"blocks_loaded": 5}
    assert merged.kv_cache_events == [BlockStored((A,), "disk", 0)]


def test_no_rank_with_a_connector_is_no_report() -> None:
    assert RankOutputs(world_size=2).merge([None, None]) is None
