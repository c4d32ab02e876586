"""The ranks' reports merged as vLLM's KVOutputAggregator merges them."""

from __future__ import annotations

from kvwire.interface.types import BlockRemoved, BlockStored, KVConnectorOutput, KVConnectorStats
from kvwire.ranks import EveryRank, RankOutputs

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


def test_a_block_every_rank_removed_is_removed_once_until_it_is_stored_again() -> None:
    every_rank = EveryRank(world_size=2)
    removed = BlockRemoved((A, B), "cpu", 0)
    assert every_rank.whole([removed, BlockRemoved((A, B), "cpu", 0)]) == [removed]
    # Stored again by both ranks, then removed again: a new removal, passed once.
    assert every_rank.whole([BlockStored((A,), "cpu", 0)] * 2) == [BlockStored((A,), "cpu", 0)]
    assert every_rank.whole([BlockRemoved((A,), "cpu", 0)] * 2) == [BlockRemoved((A,), "cpu", 0)]
