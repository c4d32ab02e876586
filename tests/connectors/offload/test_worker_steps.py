"""The offload connector worker side's checks and reports."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest

from kvwire.blocks.transfers import BlockTransfer
from kvwire.connectors.offload import CPUOffloadConnector, SharedStorageConnector
from kvwire.connectors.offload.metadata import OffloadMetadata
from kvwire.connectors.offload.worker_steps import (
    PendingRelease,
    metadata_of_type,
    registered_worker,
    saves_from_good_context,
)
from kvwire.interface.base import KVConnectorMetadata, KVConnectorRole
from kvwire.interface.counters import Counters
from kvwire.interface.types import ForwardContext
from tests.support.pairs import build_connector, cache_config_for, engine_config


def test_a_worker_is_required_once_caches_are_registered():
    with pytest.raises(
        RuntimeError,
        match=r"^MyConnector: register_kv_caches\(\) must be called before the first step$",
    ):
        registered_worker("MyConnector", None)


def test_a_registered_worker_is_returned_as_is():
    worker = object()
    assert registered_worker("MyConnector", worker) is worker


def test_metadata_of_another_type_is_refused_naming_both_types():
    with pytest.raises(
        TypeError, match=r"^MyConnector got KVConnectorMetadata, expected OffloadMetadata$"
    ):
        metadata_of_type("MyConnector", KVConnectorMetadata(), OffloadMetadata)


def test_metadata_of_the_expected_type_is_returned_as_is():
    metadata = OffloadMetadata()
    assert metadata_of_type("MyConnector", metadata, OffloadMetadata) is metadata


def test_pending_requests_are_released_once_their_transfers_end():
    pending = PendingRelease()
    pending.add(["a", "b"])
    assert pending.take_released(lambda request_id: request_id == "b") == {"a"}
    assert pending.take_released(lambda request_id: False) == {"b"}
    assert pending.take_released(lambda request_id: False) == set()


def test_counter_stats_hold_only_nonzero_counts_and_reset():
    counters = Counters()
    counters.add_many({"loaded_blocks": 3, "saved_blocks": 0})
    stats = counters.take_stats()
    assert stats is not None and stats.data == {"loaded_blocks": 3}
    assert counters.take_stats() is None


def test_the_cpu_offload_worker_refuses_a_step_before_register_kv_caches():
    config = engine_config("CPUOffloadConnector", {"cpu_pool_bytes": "4MiB"})
    worker = build_connector(
        CPUOffloadConnector, config, KVConnectorRole.WORKER, cache_config_for(config)
    )
    worker.bind_connector_metadata(OffloadMetadata())
    with pytest.raises(RuntimeError, match=r"^CPUOffloadConnector: register_kv_caches\(\)"):
        worker.start_load_kv(ForwardContext(layer_names=()))


@pytest.fixture
def unregistered_store_worker(tmp_path: pathlib.Path) -> Iterator[SharedStorageConnector]:
    """A shared-storage worker whose caches were never registered."""
    config = engine_config("SharedStorageConnector", {"shared_storage_path": str(tmp_path)})
    worker = build_connector(
        SharedStorageConnector, config, KVConnectorRole.WORKER, cache_config_for(config)
    )
    yield worker
    worker.shutdown()


def test_a_store_worker_refuses_a_step_before_register_kv_caches(unregistered_store_worker):
    unregistered_store_worker.bind_connector_metadata(OffloadMetadata())

    with pytest.raises(RuntimeError, match=r"^SharedStorageConnector: register_kv_caches\(\)"):
        unregistered_store_worker.wait_for_save()


def test_a_store_worker_refuses_another_connectors_metadata(unregistered_store_worker):
    unregistered_store_worker.bind_connector_metadata(KVConnectorMetadata())

    with pytest.raises(
        TypeError,
        match=r"^SharedStorageConnector got KVConnectorMetadata, expected OffloadMetadata$",
    ):
        unregistered_store_worker.start_load_kv(ForwardContext(layer_names=()))


def test_saves_computed_from_a_block_that_failed_to_load_are_left_out_and_counted():
    saves = [
        # Loaded blocks 1 and 2, computes 3 and 4 from them.
        BlockTransfer(
            request_id="a",
            block_ids=(3, 4),
            block_hashes=(b"h3", b"h4"),
            context_block_ids=(1, 2, 3, 4),
        ),
        # Shares block 2 as a prefix (loaded by "a"), computes 6 from it.
        BlockTransfer(
            request_id="b", block_ids=(6,), block_hashes=(b"h6",), context_block_ids=(1, 2, 6)
        ),
        BlockTransfer(
            request_id="c", block_ids=(7,), block_hashes=(b"h7",), context_block_ids=(5, 7)
        ),
    ]

    kept, left_out = saves_from_good_context(saves, {2})

    assert kept == saves[2:]
    assert left_out == saves[:2]
    assert sum(len(save.block_ids) for save in left_out) == 3
    assert saves_from_good_context(saves, set()) == (saves, [])
