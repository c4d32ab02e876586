"""A peer directory on a Redis Cluster of its own whose master hangs, then that goes away.

A master stopped (SIGSTOP) costs the directory's lookups one deadline, not a
socket timeout each, and entries are found again once the cluster has
healed. Then every node is killed once a reader engine has the slot map:
its lookups are directory failures and misses, the blocks are computed,
the tokens are the same, and nothing waits past its deadline.
"""

from __future__ import annotations

import time
import uuid

import attrs
import pytest

from kvwire.engine.engine import GenerationRequest, LLMEngine
from kvwire.media.peer._directory import Location, PeerDirectory
from kvwire.media.store.redis.settings import RedisStoreSettings
from tests.support.peers import PeerProcess, peer_config, prompts
from tests.support.redis import LocalCluster, fault_cluster
from tests.support.waits import finishes_within, wait_until

__all__ = ["fault_cluster"]


def fresh_prefix() -> str:
    return f"kvwire-test:{uuid.uuid4().hex[:12]}:"


def reference_tokens(requests: list[GenerationRequest]) -> list[tuple[int, ...]]:
    config = attrs.evolve(peer_config("redis://127.0.0.1:1/0", "unused:"), kv_transfer_config=None)
    with LLMEngine(config) as engine:
        return [output.output_token_ids for output in engine.generate(requests)]


@pytest.mark.slow
def test_a_hung_master_costs_the_directorys_lookups_one_deadline_and_hits_resume_after(
    fault_cluster: LocalCluster,
) -> None:
    settings = RedisStoreSettings.from_extra_config(
        {
            "url": fault_cluster.url,
            "key_prefix": fresh_prefix(),
            "socket_timeout_s": 10,
            "connect_timeout_s": 10,
            "retry_interval_s": 0.05,
        }
    )
    holder, reader = PeerDirectory(settings, 60.0), PeerDirectory(settings, 60.0)
    try:
        keys = [reader.entry_key("f" * 16, bytes([n]) * 16) for n in range(24)]
        assert holder.announce([(key, Location("holder", n, 1)) for n, key in enumerate(keys)])
        for node in fault_cluster.masters():  # a failover loses no entry
            assert node.client().execute_command("WAIT", 1, 5000) >= 1
        assert None not in reader.look_up(keys)  # the reader has the slot map, and connections
        hung = fault_cluster.node_of_key(keys[0])

        with hung.paused():
            # Eight requests' lookups: far within a socket timeout each (80 s).
            found = finishes_within(
                5.0, lambda: [reader.look_up(keys[n : n + 3]) for n in range(8)]
            )
            assert not reader.is_available

        assert found == [[None] * 3] * 8
        fault_cluster.wait_until_healthy()
        wait_until(lambda: None not in reader.look_up(keys), "every entry to be found again")
    finally:
        holder.close()
        reader.close()


@pytest.mark.slow
def test_a_cluster_gone_after_the_announcements_makes_misses_computed_identically(
    fault_cluster: LocalCluster,
) -> None:
    prefix = fresh_prefix()
    requests = prompts(seed=43, num_requests=2)
    producer = PeerProcess(
        url=fault_cluster.url,
        key_prefix=prefix,
        peer_name=f"{prefix}prefill",
        kv_role="kv_producer",
    )
    try:
        prefill = producer.generate([attrs.evolve(r, max_tokens=1) for r in requests])
        assert prefill["stats"]["blocks_saved"] > 0
        reader = peer_config(
            fault_cluster.url,
            prefix,
            kv_role="kv_consumer",
            peer_name=f"{prefix}decode",
            lookup_timeout_s=1,  # the default: the deadline this test bounds the run by
        )
        with LLMEngine(reader) as engine:
            # The reader has the slot map; then every node goes, replicas too.
            for node in fault_cluster.nodes:
                node.kill()
            started = time.monotonic()
            outputs = engine.generate(requests)
            took = time.monotonic() - started
            stats = dict(engine.connector_stats.data)
    finally:
        producer.stop()

    assert [o.output_token_ids for o in outputs] == reference_tokens(requests)
    assert all(o.external_tokens == 0 for o in outputs)
    assert stats["peer_directory_failures"] > 0
    assert "blocks_loaded" not in stats
    assert took < 10
