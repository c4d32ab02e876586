"""RedisClusterBlockStore on a real local cluster (3 masters, 3 replicas): keys spread by slot."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvwire.media.store.redis.cluster import RedisClusterBlockStore
from kvwire.media.store.redis.settings import RedisStoreSettings
from tests.support.redis import LocalCluster

# Each needs the six-process local cluster (about 2 s to start): kept out of the fast loop.
pytestmark = pytest.mark.slow

ENTRY_BYTES = 4096


@pytest.fixture
def make_cluster_store(
    redis_cluster: LocalCluster,
) -> Iterator[Callable[..., RedisClusterBlockStore]]:
    """Builds stores on the shared cluster, each under a key prefix of its own; cleared after."""
    stores: list[RedisClusterBlockStore] = []

    def make(**settings: Any) -> RedisClusterBlockStore:
        settings.setdefault("url", redis_cluster.url)
        # These tests are about what the store answers, not its deadlines (their
        # own tests set them): at the default 1 s, a master slow to answer on a
        # host running both suites turned a lookup into a miss (2 of 12 found).
        settings.setdefault("lookup_timeout_s", 30.0)
        settings.setdefault("key_prefix", f"kvwire-test:{uuid.uuid4().hex[:12]}:")
        store = RedisClusterBlockStore(RedisStoreSettings(**settings))
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.clear()
        store.close()


def entries(count: int) -> tuple[list[str], list[memoryview]]:
    keys = [f"layout/{index:04d}" for index in range(count)]
    values = [memoryview(bytes([index % 251]) * ENTRY_BYTES) for index in range(count)]
    return keys, values


def test_saved_blocks_are_loaded_back_byte_for_byte(
    make_cluster_store: Callable[..., RedisClusterBlockStore],
) -> None:
    store = make_cluster_store()
    keys, values = entries(40)

    assert store.put(keys, values) == [True] * 40
    buffers = [memoryview(bytearray(ENTRY_BYTES)) for _ in keys]

    assert store.get_into(keys, buffers) == [ENTRY_BYTES] * 40
    assert [bytes(buffer) for buffer in buffers] == [bytes(value) for value in values]


def test_keys_land_on_every_master(
    redis_cluster: LocalCluster, make_cluster_store: Callable[..., RedisClusterBlockStore]
) -> None:
    store = make_cluster_store()
    keys, values = entries(40)
    store.put(keys, values)

    held = {
        node.address: len(node.client().keys(store.settings.key_prefix + "*"))
        for node in redis_cluster.masters()
    }

    assert len(held) == 3
    assert all(count > 0 for count in held.values()), held
    assert sum(held.values()) == 40
    assert store.masters() == sorted(held)


def test_a_lookup_counts_the_prefix_present_across_masters(
    make_cluster_store: Callable[..., RedisClusterBlockStore],
) -> None:
    store = make_cluster_store()
    keys, values = entries(20)
    store.put(keys[:12], values[:12])
    store.put(keys[13:], values[13:])

    assert store.count_prefix(keys) == 12


def test_a_missing_key_is_a_miss_and_the_others_still_load(
    make_cluster_store: Callable[..., RedisClusterBlockStore],
) -> None:
    store = make_cluster_store()
    keys, values = entries(10)
    store.put(keys, values)
    store.delete([keys[4]])
    buffers = [memoryview(bytearray(ENTRY_BYTES)) for _ in keys]

    sizes = store.get_into(keys, buffers)

    assert sizes == [ENTRY_BYTES] * 4 + [None] + [ENTRY_BYTES] * 5


def test_clear_removes_the_prefix_from_every_master(
    redis_cluster: LocalCluster, make_cluster_store: Callable[..., RedisClusterBlockStore]
) -> None:
    store = make_cluster_store()
    keys, values = entries(30)
    store.put(keys, values)

    assert store.clear() == 30
    assert store.count_prefix(keys) == 0
    for node in redis_cluster.masters():
        assert node.client().keys(store.settings.key_prefix + "*") == []


def test_a_fresh_store_clears_what_another_saved_on_every_master(
    make_cluster_store: Callable[..., RedisClusterBlockStore],
) -> None:
    saver = make_cluster_store()
    keys, values = entries(30)
    saver.put(keys, values)

    fresh = make_cluster_store(key_prefix=saver.settings.key_prefix)

    assert fresh.clear() == 30
    assert saver.count_prefix(keys) == 0


def test_corrupt_values_found_on_any_master_are_reported_removed(
    make_cluster_store: Callable[..., RedisClusterBlockStore],
) -> None:
    store = make_cluster_store()
    keys, values = entries(12)
    store.put(keys, values)

    store.discard(keys)

    assert sorted(store.take_removed_keys()) == keys
    assert store.count_prefix(keys) == 0


def test_seeds_that_never_answer_make_every_call_a_miss_not_an_error() -> None:
    # Port 1 on loopback refuses at once: no slot map can be fetched.
    store = RedisClusterBlockStore(
        RedisStoreSettings(url="redis+cluster://127.0.0.1:1", retry_interval_s=60.0)
    )
    keys, values = entries(3)
    try:
        assert not store.is_available
        assert store.count_prefix(keys) == 0
        assert store.put(keys, values) == [False] * 3
        assert store.get_into(keys, [memoryview(bytearray(ENTRY_BYTES))] * 3) == [None] * 3
        assert store.take_counters() == {
            "redis_lookup_failures": 3,
            "redis_saves_dropped": 3,
            "redis_load_failures": 3,
        }
    finally:
        store.close()


def test_a_slot_map_that_cannot_be_fetched_is_warned_about_once_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvwire.media.store.redis.cluster")
    store = RedisClusterBlockStore(
        RedisStoreSettings(
            url="redis+cluster://kv:hunter2@127.0.0.1:1",
            retry_interval_s=0.001,
            warning_interval_s=60.0,
        )
    )
    try:
        # Every call asks for the map again; the refresher retries every millisecond.
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:
            store.count_prefix(["a"])
    finally:
        store.close()

    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1
    assert "no slot map" in warnings[0]
    assert "hunter2" not in warnings[0]
