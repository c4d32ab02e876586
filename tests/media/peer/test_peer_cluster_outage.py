"""Engines whose peer directory is a Redis Cluster that goes away after the announcements.

Every node of a cluster of its own is killed once the reader has the slot
map: its lookups are directory failures and misses, the blocks are
computed, the tokens are the same, and nothing waits past its deadline.
"""

from __future__ import annotations

import time
import uuid

import attrs
import pytest

from kvwire.engine.engine import GenerationRequest, LLMEngine
from tests.support.peer_engines import peer_config, prompts
from tests.support.peers import PeerProcess
from tests.support.redis_cluster import LocalCluster, fault_cluster

__all__ = ["fault_cluster"]


def fresh_prefix() -> str:
    return f"kvwire-test:{uuid.uuid4().hex[:12]}:"


def reference_tokens(requests: list[GenerationRequest]) -> list[tuple[int, ...]]:
    config = attrs.evolve(peer_config("redis://127.0.0.1:1/0", "unused:"), kv_transfer_config=None)
    with LLMEngine(config) as engine:
        return [output.output_token_ids for output in engine.generate(requests)]


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
            fault_cluster.url, prefix, kv_role="kv_consumer", peer_name=f"{prefix}decode"
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
