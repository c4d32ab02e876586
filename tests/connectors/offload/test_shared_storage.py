"""The shared-storage connector, driven directly over real paged caches."""

from __future__ import annotations

import io
import logging
import os
import pathlib
import shutil
import threading

import pytest
import yaml

from kvwire.cli import check_profile
from kvwire.config.extra_config import ExtraConfigError, read_extra_config
from kvwire.connectors.offload import SharedStorageConnector
from kvwire.interface.base import KVConnectorRole
from kvwire.interface.types import KVCacheBlocks, SchedulerOutput
from kvwire.media.store.directory import DirectoryMedium
from kvwire.media.store.directory.block_store import DirectoryBlockStore
from tests.support.page_cache import resident_pages
from tests.support.pairs import (
    PairFactory,
    blocks_equal,
    build_connector,
    cache_config_for,
    engine_config,
    make_request,
)

BLOCK = 4
PROMPT = list(range(100, 117))  # 17 tokens: 4 full blocks, one token left to compute
PRODUCER_BLOCKS = [3, 7, 1, 9, 12]
CONSUMER_BLOCKS = [20, 21, 22, 23, 24]
# A layout fingerprint's folder, for tests of the directory store on its own.
LAYOUT_FOLDER = "0123456789abcdef" * 2


def entry_files(root: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))


def produce(build: PairFactory) -> None:
    producer = build(seed=1)
    producer.prefill(make_request("p", PROMPT, BLOCK), PRODUCER_BLOCKS)
    assert producer.worker.wait_for_pending_saves(30)  # type: ignore[attr-defined]
    return producer


def test_a_consumer_loads_bit_exact_what_a_producer_saved(shared_storage_pair: PairFactory):
    producer = produce(shared_storage_pair)
    consumer = shared_storage_pair()
    matched, is_async = consumer.prefill(make_request("c", PROMPT, BLOCK), CONSUMER_BLOCKS)
    assert (matched, is_async) == (16, False)
    assert consumer.load_errors == set()
    assert blocks_equal(producer.caches, PRODUCER_BLOCKS[:4], consumer.caches, CONSUMER_BLOCKS[:4])


def test_one_file_per_block_in_sharded_folders(shared_storage_pair: PairFactory, storage_dir):
    produce(shared_storage_pair)
    files = entry_files(storage_dir)
    assert len(files) == 4
    for path in files:
        assert path.parent.name == path.name[:2]


def test_lookup_counts_only_the_consecutive_prefix(shared_storage_pair: PairFactory, storage_dir):
    produce(shared_storage_pair)
    hashes = make_request("c", PROMPT, BLOCK).block_hashes
    second = next(p for p in entry_files(storage_dir) if p.name == hashes[1].hex())
    second.unlink()
    consumer = shared_storage_pair()
    assert consumer.lookup(make_request("c", PROMPT, BLOCK)) == (BLOCK, False)


def test_lookup_counts_only_blocks_beyond_the_local_prefix(shared_storage_pair: PairFactory):
    produce(shared_storage_pair)
    consumer = shared_storage_pair()
    assert consumer.lookup(make_request("c", PROMPT, BLOCK), 2 * BLOCK) == (2 * BLOCK, False)


def test_lookup_leaves_the_last_token_to_compute(shared_storage_pair: PairFactory):
    produce(shared_storage_pair)
    consumer = shared_storage_pair()
    assert consumer.lookup(make_request("c", PROMPT[:16], BLOCK)) == (3 * BLOCK, False)


def test_a_flipped_byte_is_a_load_error_never_counted_loaded(
    shared_storage_pair: PairFactory, storage_dir
):
    produce(shared_storage_pair)
    hashes = make_request("c", PROMPT, BLOCK).block_hashes
    victim = next(p for p in entry_files(storage_dir) if p.name == hashes[2].hex())
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0x40
    victim.write_bytes(bytes(data))
    consumer = shared_storage_pair()
    consumer.prefill(make_request("c", PROMPT, BLOCK), CONSUMER_BLOCKS)
    # Read straight into the cache, checked there: its block holds garbage the
    # engine never uses, as it computes the block again.
    assert consumer.load_errors == {CONSUMER_BLOCKS[2]}
    assert consumer.stats["corrupt_entries"] == 1
    assert consumer.stats["blocks_loaded"] == 3


def test_a_corrupt_entry_is_discarded_so_that_it_stops_being_a_hit(
    shared_storage_pair: PairFactory, storage_dir
):
    produce(shared_storage_pair)
    hashes = make_request("c", PROMPT, BLOCK).block_hashes
    victim = next(p for p in entry_files(storage_dir) if p.name == hashes[1].hex())
    victim.write_bytes(victim.read_bytes()[:-1] + b"?")
    consumer = shared_storage_pair()
    consumer.prefill(make_request("c", PROMPT, BLOCK), CONSUMER_BLOCKS)
    assert consumer.load_errors == {CONSUMER_BLOCKS[1]}
    assert not victim.exists()
    assert consumer.lookup(make_request("d", PROMPT, BLOCK)) == (BLOCK, False)


def test_a_truncated_entry_is_a_load_error(shared_storage_pair: PairFactory, storage_dir):
    produce(shared_storage_pair)
    victim = entry_files(storage_dir)[0]
    victim.write_bytes(victim.read_bytes()[:300])
    consumer = shared_storage_pair()
    consumer.prefill(make_request("c", PROMPT, BLOCK), CONSUMER_BLOCKS)
    assert len(consumer.load_errors) == 1


def test_an_entry_vanishing_between_lookup_and_load_is_a_load_error(
    shared_storage_pair: PairFactory, storage_dir
):
    produce(shared_storage_pair)
    consumer = shared_storage_pair()
    request = make_request("c", PROMPT, BLOCK)
    matched, _ = consumer.lookup(request)
    for path in entry_files(storage_dir):
        path.unlink()
    consumer.scheduler.update_state_after_alloc(request, KVCacheBlocks((CONSUMER_BLOCKS,)), matched)
    consumer.step(SchedulerOutput())
    assert consumer.load_errors == set(CONSUMER_BLOCKS[:4])


def test_engines_with_other_layouts_never_see_each_others_blocks(
    shared_storage_pair: PairFactory, storage_dir
):
    produce(shared_storage_pair)
    config = engine_config(
        "SharedStorageConnector", {"shared_storage_path": str(storage_dir)}, head_size=8
    )
    other = build_connector(
        SharedStorageConnector, config, KVConnectorRole.SCHEDULER, cache_config_for(config)
    )
    assert other.get_num_new_matched_tokens(make_request("o", PROMPT, BLOCK), 0) == (0, False)


def test_async_loads_are_reported_through_get_finished(shared_storage_pair: PairFactory):
    producer = produce(shared_storage_pair)
    consumer = shared_storage_pair(async_load=True)
    assert consumer.prefill(make_request("c", PROMPT, BLOCK), CONSUMER_BLOCKS) == (16, True)
    consumer.step_until(lambda: "c" in consumer.finished_recving)
    assert consumer.finished_recving == {"c"}
    assert blocks_equal(producer.caches, PRODUCER_BLOCKS[:4], consumer.caches, CONSUMER_BLOCKS[:4])


def test_loads_complete_whatever_the_bound_on_saves_in_flight(shared_storage_pair: PairFactory):
    producer = produce(shared_storage_pair)
    # max_save_bytes_in_flight bounds saves only: loads go straight into the cache.
    consumer = shared_storage_pair(max_save_bytes_in_flight=1, batch_blocks=1)
    consumer.prefill(make_request("c", PROMPT, BLOCK), CONSUMER_BLOCKS)
    assert consumer.load_errors == set()
    assert blocks_equal(producer.caches, PRODUCER_BLOCKS[:4], consumer.caches, CONSUMER_BLOCKS[:4])


def test_saves_beyond_the_bytes_in_flight_are_dropped_not_waited_for(
    shared_storage_pair: PairFactory, storage_dir, caplog
):
    # A bound of one entry: the step's first block is saved, the other three are dropped.
    producer = shared_storage_pair(seed=1, max_save_bytes_in_flight=1)
    with caplog.at_level(logging.WARNING):
        producer.prefill(make_request("p", PROMPT, BLOCK), PRODUCER_BLOCKS)
    assert producer.worker.wait_for_pending_saves(30)
    assert producer.stats["saves_dropped"] == 3
    assert "saves in flight hold kv_connector_extra_config.max_save_bytes_in_flight" in caplog.text
    hashes = make_request("p", PROMPT, BLOCK).block_hashes
    assert [path.name for path in entry_files(storage_dir)] == [hashes[0].hex()]


def test_stats_count_blocks_bytes_and_lookups(shared_storage_pair: PairFactory):
    producer = produce(shared_storage_pair)
    producer.step(SchedulerOutput())
    assert producer.stats["blocks_saved"] == 4
    assert producer.stats["lookup_miss_blocks"] == 4
    consumer = shared_storage_pair()
    consumer.prefill(make_request("c", PROMPT, BLOCK), CONSUMER_BLOCKS)
    assert consumer.stats["blocks_loaded"] == 4
    assert consumer.stats["lookup_hit_blocks"] == 4
    assert consumer.stats["bytes_loaded"] == 4 * consumer.worker.layout.payload_bytes


def test_a_consumer_only_engine_saves_nothing(shared_storage_pair: PairFactory, storage_dir):
    consumer = shared_storage_pair(seed=1, kv_role="kv_consumer")
    consumer.prefill(make_request("c", PROMPT, BLOCK), CONSUMER_BLOCKS)
    consumer.worker.wait_for_pending_saves(30)
    assert entry_files(storage_dir) == []


def test_a_producer_only_engine_never_loads(shared_storage_pair: PairFactory):
    produce(shared_storage_pair)
    producer = shared_storage_pair(kv_role="kv_producer")
    assert producer.lookup(make_request("c", PROMPT, BLOCK)) == (0, False)


def test_a_vanished_directory_fails_saves_with_a_warning_and_a_count(
    shared_storage_pair: PairFactory, storage_dir, caplog
):
    producer = shared_storage_pair(seed=1)
    shutil.rmtree(storage_dir)
    with caplog.at_level(logging.WARNING):
        producer.prefill(make_request("p", PROMPT, BLOCK), PRODUCER_BLOCKS)
        assert producer.worker.wait_for_pending_saves(30)
        producer.step(SchedulerOutput())
    assert producer.stats["save_errors"] == 4
    assert producer.stats["write_directory_missing"] == 4
    assert "directory_missing" in caplog.text
    assert not storage_dir.exists()


def test_the_size_cap_evicts_the_oldest_entries(shared_storage_pair: PairFactory, storage_dir):
    probe = shared_storage_pair()
    entry_bytes = probe.worker.layout.entry_bytes
    producer = shared_storage_pair(seed=1, max_bytes=3 * entry_bytes, batch_blocks=1)
    producer.prefill(make_request("p", PROMPT, BLOCK), PRODUCER_BLOCKS)
    assert producer.worker.wait_for_pending_saves(30)
    producer.step(SchedulerOutput())
    assert sum(p.stat().st_size for p in entry_files(storage_dir)) <= 3 * entry_bytes
    assert producer.stats["evicted_blocks"] >= 1


def test_a_writers_leftover_temporary_file_is_never_loaded(
    shared_storage_pair: PairFactory, storage_dir
):
    producer = produce(shared_storage_pair)
    for path in entry_files(storage_dir):
        # What a writer killed before its rename leaves behind.
        os.rename(path, path.parent / f".{path.name}.123.456.tmp")
    consumer = shared_storage_pair()
    assert consumer.lookup(make_request("c", PROMPT, BLOCK)) == (0, False)
    del producer


def test_fsync_mode_round_trips(shared_storage_pair: PairFactory):
    producer = shared_storage_pair(seed=5, fsync=True)
    producer.prefill(make_request("p", PROMPT, BLOCK), PRODUCER_BLOCKS)
    assert producer.worker.wait_for_pending_saves(30)
    consumer = shared_storage_pair()
    assert consumer.lookup(make_request("c", PROMPT, BLOCK)) == (16, False)


def test_a_connector_with_page_cache_drop_saves_and_loads_around_the_page_cache(
    shared_storage_pair: PairFactory, storage_dir: pathlib.Path
):
    producer = shared_storage_pair(seed=4, page_cache="drop")
    producer.prefill(make_request("p", PROMPT, BLOCK), PRODUCER_BLOCKS)
    assert producer.worker.wait_for_pending_saves(30)  # type: ignore[attr-defined]
    files = [str(path) for path in entry_files(storage_dir)]
    assert len(files) == 4
    assert [resident_pages(path) for path in files] == [0] * 4

    consumer = shared_storage_pair(page_cache="drop")
    matched, is_async = consumer.prefill(make_request("c", PROMPT, BLOCK), CONSUMER_BLOCKS)

    assert (matched, is_async) == (16, False)
    assert consumer.load_errors == set()
    assert blocks_equal(producer.caches, PRODUCER_BLOCKS[:4], consumer.caches, CONSUMER_BLOCKS[:4])
    assert [resident_pages(path) for path in files] == [0] * 4


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, "kv_connector_extra_config.shared_storage_path is required"),
        ({"shared_storage_path": ""}, "kv_connector_extra_config.shared_storage_path: ''"),
        ({"shared_storage_path": "/tmp/x", "fsync": "yes"}, "kv_connector_extra_config.fsync"),
        (
            {"shared_storage_path": "/tmp/x", "max_bytes": "lots"},
            'expected a byte count >= 0, as an int or a string such as "512MiB"',
        ),
        (
            {"shared_storage_path": "/tmp/x", "io_threads": 0},
            "kv_connector_extra_config.io_threads: 0 is not accepted by SharedStorageConnector; "
            "expected an integer between 1 and 64",
        ),
        (
            {"shared_storage_path": "/tmp/x", "shared_path": "/tmp/y"},
            "kv_connector_extra_config.shared_path is not an option of SharedStorageConnector",
        ),
    ],
)
def test_bad_extra_config_names_the_key_and_what_is_accepted(extra, message):
    config = engine_config("SharedStorageConnector", extra)
    with pytest.raises(ExtraConfigError) as raised:
        build_connector(
            SharedStorageConnector, config, KVConnectorRole.SCHEDULER, cache_config_for(config)
        )
    assert message in str(raised.value)


def test_a_nul_byte_in_the_path_is_an_error_that_names_the_key():
    # The profile's own checks may catch it before the connector's do: either names the key.
    with pytest.raises(ValueError) as raised:
        config = engine_config("SharedStorageConnector", {"shared_storage_path": "/tmp/kv\0store"})
        build_connector(
            SharedStorageConnector, config, KVConnectorRole.SCHEDULER, cache_config_for(config)
        )
    assert "kv_connector_extra_config.shared_storage_path" in str(raised.value)
    assert "NUL byte" in str(raised.value)


def test_a_store_root_with_a_nul_byte_is_refused_and_shown_bounded():
    with pytest.raises(ValueError) as raised:
        DirectoryBlockStore("/tmp/" + "k" * 10_000 + "\0", entry_bytes=4096)
    assert "contains a NUL byte" in str(raised.value)
    assert len(str(raised.value)) < 300


def test_the_connector_accepts_no_path_with_a_nul_byte():
    with pytest.raises(ExtraConfigError) as raised:
        read_extra_config(
            "SharedStorageConnector",
            {"shared_storage_path": "/tmp/kv\0store"},
            DirectoryMedium.extra_config_keys(),
        )
    assert str(raised.value) == (
        "kv_connector_extra_config.shared_storage_path: '/tmp/kv\\x00store' is not accepted "
        "by SharedStorageConnector; expected a non-empty directory path without NUL bytes "
        "(required)"
    )


def test_kvwire_check_names_the_path_with_a_nul_byte(tmp_path: pathlib.Path):
    profile = tmp_path / "profile.yaml"
    transfer = {
        "kv_connector": "SharedStorageConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv\0store"},
    }
    profile.write_text(yaml.safe_dump({"kv_transfer_config": transfer}))
    out, err = io.StringIO(), io.StringIO()
    assert check_profile(str(profile), out=out, err=err) == 1
    assert "kv_connector_extra_config.shared_storage_path" in err.getvalue()
    assert "NUL byte" in err.getvalue()


def test_a_directory_store_refuses_a_root_with_a_nul_byte():
    from kvwire.media.store.directory.block_store import DirectoryBlockStore

    with pytest.raises(ValueError, match="root '/tmp/kv\\\\x00store' contains a NUL byte"):
        DirectoryBlockStore("/tmp/kv\0store", entry_bytes=100)


def test_a_path_that_cannot_be_created_is_a_clear_error(tmp_path: pathlib.Path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    config = engine_config("SharedStorageConnector", {"shared_storage_path": str(blocker / "d")})
    with pytest.raises(ExtraConfigError, match="shared_storage_path: cannot create"):
        build_connector(
            SharedStorageConnector, config, KVConnectorRole.SCHEDULER, cache_config_for(config)
        )


def test_sizes_accept_units(tmp_path: pathlib.Path):
    config = engine_config(
        "SharedStorageConnector",
        {
            "shared_storage_path": str(tmp_path),
            "max_bytes": "2GiB",
            "max_save_bytes_in_flight": "1MB",
        },
    )
    build_connector(
        SharedStorageConnector, config, KVConnectorRole.SCHEDULER, cache_config_for(config)
    )


def test_registering_caches_of_another_shape_is_a_clear_error(tmp_path: pathlib.Path):
    import torch

    config = engine_config("SharedStorageConnector", {"shared_storage_path": str(tmp_path)})
    worker = build_connector(
        SharedStorageConnector, config, KVConnectorRole.WORKER, cache_config_for(config)
    )
    caches = {f"layers.{i}.attn": torch.zeros(2, 8, 4, 2, 8) for i in range(2)}
    with pytest.raises(ValueError, match=r"layer 'layers.0.attn' has shape \(2, 8, 4, 2, 8\)"):
        worker.register_kv_caches(caches)


def test_reset_cache_forgets_this_layouts_entries_only(
    shared_storage_pair: PairFactory, storage_dir
):
    produce(shared_storage_pair)
    foreign = storage_dir / LAYOUT_FOLDER / "ab" / "ab01"
    foreign.parent.mkdir(parents=True)
    foreign.write_bytes(b"entry of another engine layout")
    consumer = shared_storage_pair()
    assert consumer.scheduler.reset_cache() is True
    assert consumer.lookup(make_request("c", PROMPT, BLOCK)) == (0, False)
    assert foreign.exists()


def test_reset_cache_keeps_the_users_files_in_the_layouts_folder(
    shared_storage_pair: PairFactory, storage_dir
):
    produce(shared_storage_pair)
    (layout_folder,) = storage_dir.iterdir()
    users = [layout_folder / "notes.txt", entry_files(storage_dir)[0].parent / "notes.txt"]
    for path in users:
        path.write_text("the user's")
    consumer = shared_storage_pair()
    assert consumer.scheduler.reset_cache() is True
    assert consumer.lookup(make_request("c", PROMPT, BLOCK)) == (0, False)
    assert [path.read_text() for path in users] == ["the user's", "the user's"]


@pytest.mark.timeout(20)
def test_shutdown_waits_for_a_stuck_start_up_sweep_only_so_long(
    shared_storage_pair: PairFactory, monkeypatch: pytest.MonkeyPatch, caplog
):
    from kvwire.media.store.directory import medium as directory
    from kvwire.media.store.directory.block_store import DirectoryBlockStore

    stuck = threading.Event()

    def sweep_on_a_hung_filesystem(store: DirectoryBlockStore) -> int:
        stuck.wait(30)
        return 0

    monkeypatch.setattr(
        DirectoryBlockStore, "sweep_stale_temporary_files", sweep_on_a_hung_filesystem
    )
    monkeypatch.setattr(directory, "SWEEP_JOIN_S", 0.05)
    pair = shared_storage_pair()
    try:
        with caplog.at_level(logging.WARNING):
            pair.worker.shutdown()
        assert "shutting down without waiting for it" in caplog.text
    finally:
        stuck.set()


def test_a_request_finished_during_its_async_load_keeps_its_blocks_until_the_load_ends(
    shared_storage_pair: PairFactory,
):
    producer = produce(shared_storage_pair)
    consumer = shared_storage_pair(async_load=True)
    request = make_request("c", PROMPT, BLOCK)
    matched, _ = consumer.lookup(request)
    consumer.scheduler.update_state_after_alloc(request, KVCacheBlocks((CONSUMER_BLOCKS,)), matched)
    # Aborted before its load ran: the load still writes into its blocks.
    assert consumer.scheduler.request_finished(request, CONSUMER_BLOCKS) == (True, None)
    consumer.step_until(lambda: "c" in consumer.finished_sending)
    assert blocks_equal(producer.caches, PRODUCER_BLOCKS[:4], consumer.caches, CONSUMER_BLOCKS[:4])


def test_old_temporary_files_of_dead_writers_are_swept(storage_dir):
    from kvwire.media.store.directory.block_store import DirectoryBlockStore

    shard = storage_dir / LAYOUT_FOLDER / "ab"
    shard.mkdir(parents=True)
    stale, fresh = shard / ".ab12.4242.1.tmp", shard / ".ab34.4242.2.tmp"
    stale.write_bytes(b"half an entry")
    fresh.write_bytes(b"a save in progress")
    os.utime(stale, (0, 0))
    assert DirectoryBlockStore(storage_dir, entry_bytes=100).sweep_stale_temporary_files() == 1
    assert not stale.exists() and fresh.exists()


def test_the_directory_store_hands_over_the_keys_it_removed_once(tmp_path: pathlib.Path):
    from kvwire.media.store.directory.block_store import DirectoryBlockStore

    store = DirectoryBlockStore(tmp_path, entry_bytes=100, max_bytes=250)
    keys = [f"{LAYOUT_FOLDER}/{i:02x}aa" for i in range(4)]
    for key in keys:
        assert store.put([key], [memoryview(bytes(100))]) == [True]
        # Eviction is oldest first: make the order of the writes unambiguous.
        os.utime(store.path_of(key), (len(keys), keys.index(key)))
    store.discard([keys[3], f"{LAYOUT_FOLDER}/ffff"])
    # Each write over the cap evicted the oldest entry; then the discarded one
    # (a key with no file was not removed, so it is not reported).
    assert store.take_removed_keys() == [keys[0], keys[1], keys[3]]
    assert store.take_removed_keys() == []
    assert [os.path.exists(store.path_of(key)) for key in keys] == [False, False, True, False]
    assert store.take_counters()["discarded_entries"] == 1  # the key with a file


def test_a_path_that_cannot_be_created_is_shown_bounded_in_the_error(tmp_path: pathlib.Path):
    (tmp_path / "a-file").write_bytes(b"")
    path = str(tmp_path / "a-file" / "/".join(["a" * 200] * 25))
    config = engine_config("SharedStorageConnector", {"shared_storage_path": path})

    with pytest.raises(ExtraConfigError) as raised:
        build_connector(
            SharedStorageConnector, config, KVConnectorRole.SCHEDULER, cache_config_for(config)
        )

    message = str(raised.value)
    assert message.startswith("kv_connector_extra_config.shared_storage_path: cannot create")
    assert f"a str of {len(path)} characters" in message
    assert len(message) < 400
