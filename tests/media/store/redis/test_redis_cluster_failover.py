"""A Redis Cluster changing under running engines: a master killed (its replica takes over),
slots moved between masters. Outputs stay identical, and hits resume on the new owners.

The module has a cluster of its own (``fault_cluster``): each test leaves it
healthy again, with three masters, though perhaps fewer replicas.
"""

from __future__ import annotations

import time

import attrs
import pytest

from kvwire.config import EngineConfig, SchedulerConfig
from kvwire.connectors.offload import RedisConnector
from kvwire.engine.engine import GenerationRequest, LLMEngine
from kvwire.media.store.redis import RedisMedium
from kvwire.media.store.redis.cluster import RedisClusterBlockStore
from kvwire.media.store.redis.settings import RedisStoreSettings
from tests.support.redis import (
    BLOCK_SIZE,
    ClusterNode,
    LocalCluster,
    distinct_prompt_blocks,
    generate,
    generate_with_stats,
    shared_prefix_workload,
    tiny_config,
    tokens,
    wait_until_available,
    with_redis,
)
from tests.support.waits import finishes_within, wait_until

pytestmark = pytest.mark.slow


def one_at_a_time() -> EngineConfig:
    """The tiny engine running one request at a time: a fault after the first step hits the rest."""
    return attrs.evolve(tiny_config(), scheduler_config=SchedulerConfig(max_num_seqs=1))


def cluster_stores(engine: LLMEngine) -> list[RedisClusterBlockStore]:
    stores = []
    for connector in (engine.scheduler_connector, engine.worker_connector):
        assert isinstance(connector, RedisConnector)
        assert isinstance(connector.medium, RedisMedium)
        store = connector.medium.store
        assert isinstance(store, RedisClusterBlockStore)
        stores.append(store)
    return stores


def node_keys(node: ClusterNode, key_prefix: str) -> set[str]:
    """The names of this test's keys that ``node`` holds."""
    return {name.decode() for name in node.client().keys(f"{key_prefix}*")}


def cluster_keys(cluster: LocalCluster, key_prefix: str) -> set[str]:
    """The names of this test's keys on every master."""
    return set().union(*(node_keys(node, key_prefix) for node in cluster.masters()))


def fresh_requests(seed: int, tag: str) -> list[GenerationRequest]:
    """Prompts that share nothing with other tests': they can only hit what this test saved."""
    return [
        attrs.evolve(request, request_id=f"{tag}-{request.request_id}")
        for request in shared_prefix_workload(seed=seed, num_requests=4)
    ]


def replicate(cluster: LocalCluster) -> None:
    """Wait until every master's replica has every write (so a killed master loses none)."""
    for node in cluster.masters():
        assert node.client().execute_command("WAIT", 1, 5000) >= 1, f"{node.address} unreplicated"


def wait_until_every_key_loads(
    store: RedisClusterBlockStore, keys: list[str], buffers: list[memoryview]
) -> None:
    """Hits resume once the store has the new slot map; fail if they do not within 10 s."""
    deadline = time.monotonic() + 10.0
    while store.get_into(keys, buffers) != [buffer.nbytes for buffer in buffers]:
        if time.monotonic() > deadline:
            raise AssertionError("not every key loads 10 s after the failover")
        time.sleep(0.01)


def test_a_dead_masters_keys_are_misses_at_once_and_the_others_still_load(
    fault_cluster: LocalCluster, key_prefix: str
) -> None:
    store = RedisClusterBlockStore(
        RedisStoreSettings(url=fault_cluster.url, key_prefix=key_prefix, retry_interval_s=0.05)
    )
    keys = [f"layout/{index:03d}" for index in range(30)]
    values = [memoryview(bytes([index]) * 1024) for index in range(30)]
    try:
        store.put(keys, values)
        replicate(fault_cluster)
        victim = fault_cluster.masters()[0]
        on_victim = {key for key in keys if fault_cluster.node_of_key(key_prefix + key) is victim}
        victim.kill()
        buffers = [memoryview(bytearray(1024)) for _ in keys]

        started = time.monotonic()
        sizes = store.get_into(keys, buffers)
        elapsed = time.monotonic() - started

        assert 0 < len(on_victim) < len(keys)
        assert [size is None for size in sizes] == [key in on_victim for key in keys]
        assert all(
            bytes(buffer) == bytes(value)
            for key, buffer, value in zip(keys, buffers, values, strict=True)
            if key not in on_victim
        )
        assert elapsed < 1.0  # refused at once, not a wait for a timeout
        assert store.take_counters()["redis_load_failures"] == len(on_victim)
        # Once the replica has taken over, the store finds it: every key loads.
        fault_cluster.wait_until_healthy()
        wait_until_every_key_loads(store, keys, buffers)
        assert [bytes(buffer) for buffer in buffers] == [bytes(value) for value in values]
    finally:
        store.close()
    fault_cluster.rejoin(victim)


def test_a_hung_master_costs_a_load_its_deadline_and_the_other_masters_keys_load(
    fault_cluster: LocalCluster, key_prefix: str
) -> None:
    store = RedisClusterBlockStore(
        RedisStoreSettings(url=fault_cluster.url, key_prefix=key_prefix, load_timeout_s=0.5)
    )
    keys = [f"layout/{index:03d}" for index in range(30)]
    values = [memoryview(bytes([index]) * 1024) for index in range(30)]
    hung = fault_cluster.masters()[0]
    try:
        store.put(keys, values)
        on_hung = {key for key in keys if fault_cluster.node_of_key(key_prefix + key) is hung}
        buffers = [memoryview(bytearray(1024)) for _ in keys]
        hung.pause()
        try:
            started = time.monotonic()
            sizes = store.get_into(keys, buffers)
            elapsed = time.monotonic() - started
        finally:
            hung.resume()

        assert 0 < len(on_hung) < len(keys)
        assert [size is None for size in sizes] == [key in on_hung for key in keys]
        assert 0.5 <= elapsed < 2.0
    finally:
        store.close()
    fault_cluster.wait_until_healthy()


def test_lookups_with_a_hung_master_wait_one_lookup_timeout_and_hit_again_once_it_answers(
    fault_cluster: LocalCluster, key_prefix: str
) -> None:
    settings = RedisStoreSettings(
        url=fault_cluster.url,
        key_prefix=key_prefix,
        socket_timeout_s=10,
        connect_timeout_s=10,
        retry_interval_s=0.05,
    )
    keys = [f"layout/{index:03d}" for index in range(30)]
    writer = RedisClusterBlockStore(settings)
    try:
        assert writer.put(keys, [memoryview(bytes([n]) * 64) for n in range(30)]) == [True] * 30
    finally:
        writer.close()
    replicate(fault_cluster)
    # A store with the slot map and no connection yet: its first lookup on the
    # hung master opens one, which a stopped server accepts and never answers.
    store = RedisClusterBlockStore(settings)
    hung = fault_cluster.node_of_key(key_prefix + keys[0])
    try:
        with hung.paused():
            # Eight requests' lookups: far within a socket timeout each (80 s).
            counts = finishes_within(
                5.0, lambda: [store.count_prefix(keys[n : n + 2]) for n in range(8)]
            )
        assert counts[0] == 0  # keys[0] is on the hung master
        fault_cluster.wait_until_healthy()
        wait_until(lambda: store.count_prefix(keys) == len(keys), "every key to hit again")
    finally:
        store.close()


def test_a_master_killed_mid_run_leaves_outputs_identical_and_hits_resume_after_failover(
    fault_cluster: LocalCluster, key_prefix: str
) -> None:
    before, after = fresh_requests(21, "before"), fresh_requests(22, "after")
    expected_before = tokens(generate(tiny_config(), before))
    expected_after = tokens(generate(tiny_config(), after))
    # The stores ask for a new slot map every 50 ms while a master is down.
    config = with_redis(one_at_a_time(), fault_cluster.url, key_prefix, retry_interval_s=0.05)
    generate(config, before)  # fills the cluster
    replicate(fault_cluster)
    # The master holding most of the blocks the run will look up and load.
    victim = max(
        fault_cluster.masters(), key=lambda node: len(node.client().keys(f"{key_prefix}*"))
    )

    with LLMEngine(config) as engine:
        for request in before:
            engine.add_request(request)
        engine.step()
        victim.kill()
        engine.run_until_done()
        outputs = [engine.output_of(request.request_id) for request in before]
        fault_cluster.wait_until_healthy()
        # The engine's stores find the promoted replica by themselves.
        wait_until_available(*cluster_stores(engine))
        assert tokens(engine.generate(after)) == expected_after
    fault_cluster.rejoin(victim)

    assert tokens(outputs) == expected_before
    assert len(fault_cluster.masters()) == 3
    # Every block saved before the kill (replicated) and after the failover loads.
    loaded, stats = generate_with_stats(config, before + after)
    assert tokens(loaded) == expected_before + expected_after
    assert stats["blocks_loaded"] == distinct_prompt_blocks(before + after, BLOCK_SIZE)
    assert stats.get("load_errors", 0) == 0


def test_slots_moved_between_masters_mid_run_leave_outputs_identical_and_hits_resume(
    fault_cluster: LocalCluster, key_prefix: str
) -> None:
    before, after = fresh_requests(31, "before"), fresh_requests(32, "after")
    expected_before = tokens(generate(tiny_config(), before))
    expected_after = tokens(generate(tiny_config(), after))
    config = with_redis(one_at_a_time(), fault_cluster.url, key_prefix)
    generate(config, before[:1])
    first_keys = cluster_keys(fault_cluster, key_prefix)
    generate(config, before)
    # Keys only the later requests read: the first step reads none of them,
    # so a read after the move is sure to reach a slot that moved.
    later_keys = cluster_keys(fault_cluster, key_prefix) - first_keys
    source = next(
        node for node in fault_cluster.masters() if later_keys & node_keys(node, key_prefix)
    )
    target = next(node for node in fault_cluster.masters() if node is not source)

    with LLMEngine(config) as engine:
        for request in before:
            engine.add_request(request)
        engine.step()
        moved = fault_cluster.move_keys_slots(
            source, target, later_keys & node_keys(source, key_prefix)
        )
        engine.run_until_done()
        outputs = [engine.output_of(request.request_id) for request in before]
        assert tokens(engine.generate(after)) == expected_after
        versions = [store.map_version for store in cluster_stores(engine)]

    assert moved > 0
    assert tokens(outputs) == expected_before
    # A MOVED answer made the store that got it fetch the new map.
    assert max(versions) > 1
    loaded, stats = generate_with_stats(config, before + after)
    assert tokens(loaded) == expected_before + expected_after
    assert stats["blocks_loaded"] == distinct_prompt_blocks(before + after, BLOCK_SIZE)
