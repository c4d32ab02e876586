"""The peer directory on a real local Redis Cluster: its calls, and engines sharing KV through it.

The directory's keys spread over the cluster's masters by slot; each call
still answers for every key, a compare-and-delete still deletes only what
it was given, and engines pull each other's blocks as with one server. A
cluster that stops answering makes misses: the blocks are computed, the
tokens are the same, and nothing waits past its deadline.
"""

from __future__ import annotations

import time
import uuid

import attrs
import pytest

from kvwire.engine.engine import GenerationRequest, LLMEngine
from kvwire.interface.types import BlockHash
from kvwire.media.peer._directory import Location, PeerDirectory, PeerRecord
from kvwire.media.store.redis._settings import RedisStoreSettings
from tests.support.peer_engines import BLOCK_SIZE, peer_config, prompts
from tests.support.peers import PeerProcess
from tests.support.redis_cluster import LocalCluster, fault_cluster, redis_cluster
from tests.support.redis_engines import distinct_prompt_blocks

__all__ = ["fault_cluster", "redis_cluster"]


def directory(cluster: LocalCluster, prefix: str, ttl_s: float = 60.0) -> PeerDirectory:
    settings = RedisStoreSettings.from_extra_config({"url": cluster.url, "key_prefix": prefix})
    return PeerDirectory(settings, ttl_s)


def fresh_prefix() -> str:
    return f"kvwire-test:{uuid.uuid4().hex[:12]}:"


def entries(made: PeerDirectory, count: int) -> list[tuple[str, Location]]:
    return [
        (made.entry_key("f00d", BlockHash(index.to_bytes(16, "big"))), Location("a", index, 7))
        for index in range(count)
    ]


def test_a_look_up_answers_for_keys_on_every_master_in_the_order_asked(
    redis_cluster: LocalCluster,
) -> None:
    made = directory(redis_cluster, fresh_prefix())
    try:
        announced = entries(made, 40)
        made.announce(announced)
        keys = [key for key, _ in announced]
        assert len({redis_cluster.node_of_key(key).address for key in keys}) == 3
        missing = made.entry_key("f00d", BlockHash(b"\xff" * 16))
        asked = [missing, *reversed(keys)]
        assert made.look_up(asked) == [None, *(location for _, location in reversed(announced))]
        assert made.take_failures() == 0
    finally:
        made.close()


def test_a_withdrawal_deletes_only_entries_still_naming_the_location_given(
    redis_cluster: LocalCluster,
) -> None:
    made = directory(redis_cluster, fresh_prefix())
    try:
        announced = entries(made, 12)
        made.announce(announced)
        # Half are asked for with another generation: a newer use of the slot stays.
        stale = [(key, attrs.evolve(location, generation=8)) for key, location in announced[:6]]
        assert made.withdraw([*stale, *announced[6:]]) == 6
        keys = [key for key, _ in announced]
        assert made.look_up(keys) == [location for _, location in announced[:6]] + [None] * 6
        assert made.take_failures() == 0
    finally:
        made.close()


def test_peer_records_and_entries_are_kept_until_their_expiry(redis_cluster: LocalCluster) -> None:
    made = directory(redis_cluster, fresh_prefix(), ttl_s=0.3)
    try:
        record = PeerRecord(b"agent metadata", 4096, 64, 10)
        assert made.publish_peer("a rank0", record) and made.publish_peer("b rank0", record)
        made.announce(entries(made, 6))
        assert made.fetch_peer("a rank0") == record
        made.withdraw_peer("b rank0")
        assert made.fetch_peer("b rank0") is None
        time.sleep(0.6)
        assert made.fetch_peer("a rank0") is None
        assert made.look_up([key for key, _ in entries(made, 6)]) == [None] * 6
        assert made.take_failures() == 0
    finally:
        made.close()


def test_a_cluster_that_never_answered_makes_misses_counted_as_failures() -> None:
    settings = RedisStoreSettings.from_extra_config(
        {"url": "redis+cluster://127.0.0.1:1", "connect_timeout_s": 1.0}
    )
    made = PeerDirectory(settings, 60.0)
    try:
        assert made.look_up(["kvwire:peer/x/00"]) == [None]
        assert not made.publish_peer("a", PeerRecord(b"m", 0, 1, 1))
        assert made.take_failures() == 2
    finally:
        made.close()


def reference_tokens(requests: list[GenerationRequest]) -> list[tuple[int, ...]]:
    config = attrs.evolve(peer_config("redis://127.0.0.1:1/0", "unused:"), kv_transfer_config=None)
    with LLMEngine(config) as engine:
        return [output.output_token_ids for output in engine.generate(requests)]


@pytest.mark.slow
def test_an_engine_pulls_another_engines_blocks_found_through_the_cluster(
    redis_cluster: LocalCluster,
) -> None:
    prefix = fresh_prefix()
    requests = prompts(seed=41, num_requests=2)
    producer = PeerProcess(
        url=redis_cluster.url,
        key_prefix=prefix,
        peer_name=f"{prefix}prefill",
        kv_role="kv_producer",
    )
    try:
        prefill = producer.generate([attrs.evolve(r, max_tokens=1) for r in requests])
        reader = peer_config(
            redis_cluster.url, prefix, kv_role="kv_consumer", peer_name=f"{prefix}decode"
        )
        with LLMEngine(reader) as engine:
            outputs = engine.generate(requests)
            stats = dict(engine.connector_stats.data)
    finally:
        producer.stop()

    assert [o.output_token_ids for o in outputs] == reference_tokens(requests)
    assert prefill["stats"]["blocks_saved"] > 0
    full = (len(requests[0].prompt_token_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert outputs[0].external_tokens == full
    assert stats["peer_blocks_pulled"] == stats["blocks_loaded"]
    assert stats["blocks_loaded"] == distinct_prompt_blocks(requests, BLOCK_SIZE)
    assert "peer_directory_failures" not in stats and "load_errors" not in stats


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
